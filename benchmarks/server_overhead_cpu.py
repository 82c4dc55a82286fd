"""What `onecat serve` costs on top of the engine on CPU: the same batch in-process and through the server.

The in-process arm runs LLM.generate over N requests with max_num_seqs = S (continuous batching); the
server arm starts `onecat serve` with the same settings and sends the same N requests from S concurrent
streaming clients (httpx, in this process). Both count output tokens over wall time; arms alternate,
repeats give medians. The client shares the machine with the server, as in the peers comparison.

    python benchmarks/server_overhead_cpu.py [--streams 16] [--requests 32] [--quantization gguf] [--out FILE]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import httpx

from onecat.engine.parallel.runtime import free_port
from onecat.results.revision import git_revision

EMBEDDED = "embedded:smollm2-135m-instruct"


def prompts(n: int, length: int) -> list[list[int]]:
    return [[1000 + (i * 131 + j * 7) % 40000 for j in range(length)] for i in range(n)]


def settings(args) -> dict:
    return {"device": "cpu", "dtype": "float32", "quantization": args.quantization, "max_model_len": 2048,
            "max_num_seqs": args.streams, "enable_prefix_caching": False}


def in_process(llm, batch: list[list[int]], output_len: int) -> dict:
    from onecat.engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(batch, params)
    wall = time.perf_counter() - t0
    n = sum(o.num_completion_tokens for o in outs)
    return {"output_tokens": n, "wall_s": wall, "output_tok_s": n / wall}


async def _one(client: httpx.AsyncClient, url: str, ids: list[int], output_len: int, gate: asyncio.Semaphore) -> int:
    async with gate:
        body = {"model": EMBEDDED, "prompt": ids, "max_tokens": output_len, "temperature": 0.0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        tokens = 0
        async with client.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    usage = json.loads(line[6:]).get("usage")
                    tokens = usage["completion_tokens"] if usage else tokens
        return tokens


async def through_server(url: str, batch: list[list[int]], output_len: int, streams: int) -> dict:
    gate = asyncio.Semaphore(streams)
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=streams)) as client:
        t0 = time.perf_counter()
        counts = await asyncio.gather(*(_one(client, url, ids, output_len, gate) for ids in batch))
        wall = time.perf_counter() - t0
    n = sum(counts)
    return {"output_tokens": n, "wall_s": wall, "output_tok_s": n / wall}


def start_server(args, port: int) -> subprocess.Popen:
    argv = [sys.executable, "-m", "onecat.cli.main", "serve", EMBEDDED, "--port", str(port), "--device", "cpu",
            "--dtype", "float32", "--max-model-len", "2048", "--max-num-seqs", str(args.streams),
            "--no-enable-prefix-caching", "--uvicorn-log-level", "warning"]
    if args.quantization:
        argv += ["--quantization", args.quantization]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"onecat serve exited ({proc.returncode}): {proc.stderr.read()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit("onecat serve did not become healthy within 180 s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quantization", choices=["gguf"], default=None)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/server_overhead_cpu.json"))
    args = ap.parse_args()

    from onecat.engine import LLM

    load_before = os.getloadavg()
    batch = prompts(args.requests, args.input_len)
    port = free_port()
    server = start_server(args, port)
    try:
        llm = LLM(EMBEDDED, **settings(args))
        in_process(llm, batch[:2], 4)  # warm both arms once
        asyncio.run(through_server(f"http://127.0.0.1:{port}", batch[:2], 4, args.streams))
        arms: dict[str, list[dict]] = {"in_process": [], "server": []}
        for _ in range(args.repeats):
            arms["in_process"].append(in_process(llm, batch, args.output_len))
            arms["server"].append(asyncio.run(through_server(f"http://127.0.0.1:{port}", batch, args.output_len,
                                                             args.streams)))
        info = llm.info()
        llm.close()
    finally:
        server.terminate()
        server.wait(30)
    med = {k: statistics.median(r["output_tok_s"] for r in v) for k, v in arms.items()}
    overhead = 1 - med["server"] / med["in_process"]
    for k, v in arms.items():
        runs = ", ".join(f"{r['output_tok_s']:.1f}" for r in v)
        print(f"{k:10s} output tok/s: {runs}  (median {med[k]:.1f})")
    print(f"server overhead at {args.streams} streams: {100 * overhead:.1f}% of in-process output tok/s")
    record = {"benchmark": "server_overhead_cpu", "when": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "git": git_revision(), "machine": {"cpu": platform.processor() or platform.machine(),
                                                 "cores": os.cpu_count(), "python": platform.python_version()},
              "load_average_before": load_before, "load_average_after": os.getloadavg(),
              "settings": vars(args) | {"out": str(args.out)}, "engine_threads": info["cpu_threads"],
              "fused_kernels": info["fused_kernels_detail"], "runs": arms, "median_output_tok_s": med,
              "server_overhead_fraction": overhead,
              "kind": "measured (this machine, client in the same box)"}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
