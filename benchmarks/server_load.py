"""Server robustness under load: 200 concurrent streaming chat requests, 20% of clients leave early.

Starts `onecat serve` on the embedded model as a separate process, fires every request at once,
lets one in five clients disconnect after a few chunks, and then checks what a user of vLLM would
check: no 5xx, the server still healthy, no request left running or waiting, and every KV block
free again (from the server's /metrics). Prints a summary and writes a JSON record.

    python benchmarks/server_load.py [--requests 200] [--disconnect-frac 0.2] [--max-tokens 48]
                                     [--out benchmarks/results/server_load.json]

Numbers from a shared 2-core CPU are noisy; they show the server holds up, not how fast it is.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path

import httpx

from onecat.gates.engines.openai_client import parse_prometheus, stream_completion
from onecat.gates.engines.server_process import ServerProcess, free_port, onecat_serve_argv
from onecat.results.revision import git_revision

EMBEDDED = "embedded:smollm2-135m-instruct"
TOPICS = ["the sea", "a small robot", "autumn", "a lighthouse", "bread", "the moon", "trains", "a city at night",
          "mountains", "a library"]


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    k = min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))
    return s[k]


async def run_load(url: str, n: int, disconnect_frac: float, max_tokens: int, seed: int) -> dict:
    rng = random.Random(seed)
    leavers = set(rng.sample(range(n), int(round(n * disconnect_frac))))
    limits = httpx.Limits(max_connections=n + 10, max_keepalive_connections=n + 10)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=httpx.Timeout(600.0)) as client:
        async def one(i: int):
            body = {"model": EMBEDDED, "max_tokens": max_tokens, "temperature": 0.8, "seed": i,
                    "messages": [{"role": "user", "content": f"Write a short poem about {TOPICS[i % len(TOPICS)]}."
                                                             f" (request {i})"}]}
            leave = rng.randint(1, 4) if i in leavers else None
            return i, await stream_completion(client, "/v1/chat/completions", body, chat=True,
                                              disconnect_after_chunks=leave)

        t0 = time.perf_counter()
        results = await asyncio.gather(*(one(i) for i in range(n)))
        wall = time.perf_counter() - t0
    return {"wall_s": wall, "results": results, "leavers": leavers}


def wait_drained(url: str, timeout_s: float = 60.0) -> dict:
    """Poll /metrics until nothing runs or waits; returns the last scrape."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = parse_prometheus(httpx.get(url + "/metrics", timeout=10).text)
        idle = m.get("vllm:num_requests_running", 1) == 0 and m.get("vllm:num_requests_waiting", 1) == 0
        if idle or time.monotonic() > deadline:
            return m
        time.sleep(0.2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--disconnect-frac", type=float, default=0.2)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-dir", default=".onecat/benchmarks/server_load")
    ap.add_argument("--out", default="benchmarks/results/server_load.json")
    args = ap.parse_args()

    port = free_port()
    server = ServerProcess(onecat_serve_argv(EMBEDDED, port=port, flags={
        "max_model_len": 2048, "max_num_seqs": args.max_num_seqs, "uvicorn_log_level": "warning"}),
        port=port, log_dir=args.log_dir, name="onecat_serve")
    server.start()
    try:
        before = parse_prometheus(httpx.get(server.url + "/metrics").text)
        load = asyncio.run(run_load(server.url, args.requests, args.disconnect_frac, args.max_tokens, args.seed))
        after = wait_drained(server.url)
        healthy = httpx.get(server.url + "/health", timeout=10).status_code == 200
        alive = server.alive
    finally:
        code = server.stop()

    results = [r for _, r in load["results"]]
    completed = [r for i, r in load["results"] if i not in load["leavers"]]
    left = [r for i, r in load["results"] if i in load["leavers"]]
    statuses: dict[str, int] = {}
    for r in results:
        statuses[str(r.status)] = statuses.get(str(r.status), 0) + 1
    ttft = [r.ttft_s for r in completed if r.ttft_s is not None]
    tpot = [r.tpot_s for r in completed if r.tpot_s is not None]
    e2e = [r.e2e_s for r in completed if r.ok]
    gen_tokens = sum(r.completion_tokens or 0 for r in completed)
    aborted = after.get("vllm:request_success_total", 0) - before.get("vllm:request_success_total", 0)
    record = {
        "benchmark": "server_load",
        "when": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {"cpu": platform.processor() or platform.machine(), "python": platform.python_version(),
                    "note": "shared 2-core CPU; timings are noisy and only indicative"},
        "git": git_revision(),
        "settings": {"model": EMBEDDED, "requests": args.requests, "disconnect_frac": args.disconnect_frac,
                     "max_tokens": args.max_tokens, "max_num_seqs": args.max_num_seqs, "temperature": 0.8},
        "outcome": {
            "http_status_counts": statuses,
            "num_5xx": sum(v for k, v in statuses.items() if k.startswith("5")),
            "num_client_errors": sum(1 for r in completed if not r.ok),
            "completed_ok": sum(1 for r in completed if r.ok),
            "disconnected_on_purpose": sum(1 for r in left if r.disconnected),
            "server_alive_after": alive, "health_after": healthy, "server_exit_code_on_stop": code,
            "requests_running_after": after.get("vllm:num_requests_running"),
            "requests_waiting_after": after.get("vllm:num_requests_waiting"),
            "kv_blocks_free_after": after.get("onecat:kv_blocks_free"),
            "kv_blocks_total": after.get("onecat:kv_blocks_total"),
            "all_kv_blocks_free": after.get("onecat:kv_blocks_free") == after.get("onecat:kv_blocks_total"),
            "finished_requests_counted_by_server": aborted,
            "preemptions": after.get("vllm:num_preemptions_total", 0) - before.get("vllm:num_preemptions_total", 0),
        },
        "measured": {
            "wall_s": load["wall_s"], "generated_tokens_completed": gen_tokens,
            "output_tok_s": gen_tokens / load["wall_s"],
            "ttft_s": {"p50": pct(ttft, 50), "p90": pct(ttft, 90), "p99": pct(ttft, 99)},
            "tpot_s": {"p50": pct(tpot, 50), "p90": pct(tpot, 90), "p99": pct(tpot, 99)},
            "e2e_s": {"p50": pct(e2e, 50), "p90": pct(e2e, 90), "max": max(e2e) if e2e else None,
                      "mean": statistics.fmean(e2e) if e2e else None},
        },
        "server_log": str(server.log_path),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record["outcome"], indent=2))
    print(json.dumps(record["measured"], indent=2))
    errors = [r.error for r in results if r.error][:3]
    if errors:
        print("first errors:", errors)


if __name__ == "__main__":
    main()
