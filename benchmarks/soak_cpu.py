"""Soak: `onecat serve` on the embedded model (CPU) under minutes of mixed traffic, with a verdict per target.

Starts `onecat serve embedded:smollm2-135m-instruct` (prefix caching on, n-gram speculation on) on a free
127.0.0.1 port and keeps `--clients` requests in flight for `--minutes` (the mix: soak_traffic.py), plus a
malformed request every `--malformed-interval-s`. It
samples the server's RSS and /metrics every `--sample-seconds`, summarises each window of
`--window-minutes` as it closes (requests, answers by status, client-side TTFT and TPOT p50/p99 of
streamed answers, tokens/s, prefix-cache and n-gram figures) and, after the traffic stops, checks:

    no_5xx               no 5xx answer (nor 5xx error event inside a stream) outside a deliberate fault
    no_lost_answers      no request left without an answer (refused, reset, timed out, stream cut short)
    malformed_4xx        every malformed request got a 4xx with the OpenAI error body (unknown fields: 200)
    rss_growth           server RSS at the end <= 1.05 x RSS at minute 5 (a quarter of the run if shorter)
    kv_blocks_free       every KV block free once nothing runs (onecat:kv_blocks_free == kv_blocks_total)
    ttft_p99_drift       p99 TTFT of the last window <= 1.5 x that of the first
    tp_fault             (--tensor-parallel-size > 1) after one worker rank is killed at --kill-minute the
                         server answers with 5xx OpenAI errors, each within --fault-deadline-s, and after the
                         caller restarts it, requests succeed again; these failures are counted apart

Writes the record (machine, settings, start time, git revision, RSS over time, windows, totals, faults,
verdicts) to `--out`, prints as it goes, and exits 0 only if every target passes.

    python benchmarks/soak_cpu.py [--minutes 20] [--window-minutes 5] [--clients 4]
                                  [--tensor-parallel-size 2 [--kill-minute M]] [--out FILE]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import shutil
import signal
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import httpx
from soak_record import Verdicts, descendants, process_rss_mib, summarise_windows, totals
from soak_traffic import Malformed, plan_request, send

from onecat.gates.engines.openai_client import parse_prometheus
from onecat.gates.engines.server_process import ServerProcess, ServerStartError, free_port
from onecat.results.revision import git_revision

EMBEDDED = "embedded:smollm2-135m-instruct"
NGRAM = {"method": "ngram", "num_speculative_tokens": 3}
WORKER_MARKS = ("onecat.engine.parallel.", "spawn_main")  # in a worker rank's command line (-m MODULE, or spawn)
FAIL_BACKOFF_S = 0.25  # a client pauses after a 5xx or no answer, as a real one would, instead of spinning


def log(msg: str) -> None:
    print(msg, flush=True)


def onecat_command() -> list[str]:
    """The `onecat` entry point of this interpreter's environment (the repository's .venv)."""
    beside = Path(sys.executable).with_name("onecat")
    if beside.exists():
        return [str(beside)]
    found = shutil.which("onecat")
    return [found] if found else [sys.executable, "-m", "onecat.cli.main"]


def server_argv(args, port: int) -> list[str]:
    return [*onecat_command(), "serve", args.model, "--host", "127.0.0.1", "--port", str(port), "--device", "cpu",
            "--max-model-len", str(args.max_model_len), "--enable-prefix-caching",
            "--speculative-config", json.dumps(NGRAM), "--tensor-parallel-size", str(args.tensor_parallel_size),
            "--seed", str(args.seed), "--uvicorn-log-level", "warning"]


def machine() -> dict:
    cpu = "unknown"
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    mem_kib = next((int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines()
                    if line.startswith("MemTotal:")), 0) if Path("/proc/meminfo").exists() else 0
    return {"cpu_model": cpu, "cores": os.cpu_count(), "cores_usable": len(os.sched_getaffinity(0)),
            "mem_total_gib": round(mem_kib / 2**20, 1), "python": platform.python_version(),
            "load_average_before": os.getloadavg()}


class Soak:
    """The server, the clients, the samplers and, with tensor parallel, the worker kill and restart."""

    def __init__(self, args):
        self.args = args
        self.port = free_port()
        self.argv = server_argv(args, self.port)
        self.url = f"http://127.0.0.1:{self.port}"
        self.duration_s = args.minutes * 60
        self.server: ServerProcess | None = None
        self.generation = 0
        self.generation_start_s = [0.0]
        self.outcomes: list = []
        self.samples: list[dict] = []
        self.boundaries: list[dict] = []  # /metrics at each window boundary
        self.faults: list[dict] = []
        self.serving = asyncio.Event()
        self.in_flight = 0
        self.t0 = 0.0

    def now(self) -> float:
        return time.monotonic() - self.t0

    def start_server(self) -> None:
        self.server = ServerProcess(self.argv, port=self.port, log_dir=self.args.log_dir,
                                    name=f"onecat_serve_{self.generation}")
        self.server.start()

    # ---- samplers ---------------------------------------------------------------------------------------
    async def scrape(self, client: httpx.AsyncClient) -> dict:
        try:
            return parse_prometheus((await client.get("/metrics", timeout=10)).text)
        except httpx.HTTPError:
            return {}

    async def sample_loop(self, client: httpx.AsyncClient) -> None:
        while self.now() < self.duration_s:
            await self.take_sample(client)
            await asyncio.sleep(min(self.args.sample_seconds, max(0.1, self.duration_s - self.now())))

    async def take_sample(self, client: httpx.AsyncClient, label: str = "") -> dict | None:
        if not self.serving.is_set() or self.server is None or not self.server.alive:
            return None
        own, children = process_rss_mib(self.server.proc.pid)
        m = await self.scrape(client)
        done = list(self.outcomes)
        s = {"t_s": round(self.now(), 1), "generation": self.generation, "rss_mib": own,
             "children_rss_mib": children, "kv_blocks_free": m.get("onecat:kv_blocks_free"),
             "kv_blocks_total": m.get("onecat:kv_blocks_total"), "running": m.get("vllm:num_requests_running"),
             "waiting": m.get("vllm:num_requests_waiting"), "requests_done": len(done),
             "num_5xx": sum(o.is_5xx and not o.fault for o in done)}
        self.samples.append(s)
        log(f"[{s['t_s']:7.1f}s]{label} rss {own:.1f} MiB (+{children:.1f} children)  kv free "
            f"{s['kv_blocks_free']}/{s['kv_blocks_total']}  running {s['running']} waiting {s['waiting']}  "
            f"requests {s['requests_done']}  5xx {s['num_5xx']}")
        return s

    async def window_loop(self, client: httpx.AsyncClient) -> None:
        """Scrape /metrics at each window boundary and print the window that just closed."""
        self.boundaries.append(await self.scrape(client))
        for k in range(1, self.args.num_windows):
            await asyncio.sleep(max(0.0, k * self.window_s - self.now()))
            self.boundaries.append(await self.scrape(client))  # {} while the server restarts
            self.print_window(k - 1)

    @property
    def window_s(self) -> float:
        return self.duration_s / self.args.num_windows

    def print_window(self, k: int) -> None:
        w = summarise_windows(self.outcomes, self.boundaries, self.window_s, k + 1)[k]
        ttft, tpot = w["ttft_s"], w["tpot_s"]

        def ms(v):
            return "-" if v is None else f"{1000 * v:.0f}"

        log(f"== window {k} [{w['start_s']:.0f}-{w['end_s']:.0f} s]: {w['requests']} requests {w['by_status']}  "
            f"TTFT p50/p99 {ms(ttft['p50'])}/{ms(ttft['p99'])} ms  TPOT p50/p99 {ms(tpot['p50'])}/{ms(tpot['p99'])}"
            f" ms  {w['tokens_per_s']:.1f} tok/s  prefix-cache hit tokens {w['prefix_cache']['hit_tokens']}")

    # ---- clients ------------------------------------------------------------------------------------------
    async def client_loop(self, client: httpx.AsyncClient, cid: int) -> None:
        """One client: a well-formed request from the mix, then the next, until the time is up."""
        rng = random.Random(self.args.seed * 1000 + cid)
        while self.now() < self.duration_s:
            if not self.serving.is_set():
                await asyncio.sleep(0.2)
                continue
            await self.send(client, plan_request(rng, self.args.model, tuple(self.args.max_tokens)))

    async def malformed_loop(self, client: httpx.AsyncClient) -> None:
        """The trickle of malformed requests: one every --malformed-interval-s, cycling through the cases."""
        bad = Malformed(self.args.model, self.args.max_model_len)
        while self.now() < self.duration_s:
            await asyncio.sleep(min(self.args.malformed_interval_s, max(0.0, self.duration_s - self.now())))
            if self.serving.is_set() and self.now() < self.duration_s:
                await self.send(client, bad.plan())

    async def send(self, client: httpx.AsyncClient, plan) -> None:
        gen = self.generation
        self.in_flight += 1
        try:
            out = await send(client, plan, self.t0, self.args.request_timeout_s)
        finally:
            self.in_flight -= 1
        out.generation = gen
        kill = next((f["kill_s"] for f in self.faults if f["generation"] == gen), None)
        out.fault = kill is not None and out.finished_s >= kill
        self.outcomes.append(out)
        if (out.is_5xx and not out.fault) or out.status_key in ("no_answer", "stream_broken") \
                or (out.expect == "4xx" and not out.fault and not 400 <= out.status < 500):
            log(f"  ! {out.path} {out.kind}: {out.status_key} {out.error}")
        if out.is_5xx or out.status_key == "no_answer":
            await asyncio.sleep(FAIL_BACKOFF_S)

    # ---- tensor parallel: kill a worker rank, then restart the server -------------------------------------
    def worker_ranks(self) -> list[tuple[int, str]]:
        """(pid, command line) of the server's tensor-parallel worker ranks."""
        return [(pid, line) for pid, line in descendants(self.server.proc.pid)
                if any(mark in line for mark in WORKER_MARKS)]

    async def fault_loop(self, client: httpx.AsyncClient) -> None:
        await asyncio.sleep(max(0.0, self.args.kill_minute * 60 - self.now()))
        workers = self.worker_ranks()
        if not workers:
            self.faults.append({"generation": self.generation, "kill_s": None, "error": "no worker rank found",
                                "descendants": descendants(self.server.proc.pid)})
            log("  ! no tensor-parallel worker rank among the server's children")
            return
        victim, cmdline = workers[-1]
        fault = {"generation": self.generation, "worker_pid": victim, "worker_cmdline": cmdline, "kill_s": self.now()}
        self.faults.append(fault)
        os.kill(victim, signal.SIGKILL)
        log(f"[{fault['kill_s']:7.1f}s] killed tensor-parallel worker rank pid {victim}")
        await asyncio.sleep(self.args.fault_probe_seconds)
        try:
            fault["health_after_kill"] = (await client.get("/health", timeout=5)).status_code
        except httpx.HTTPError as exc:
            fault["health_after_kill"] = f"{type(exc).__name__}"
        self.serving.clear()
        wait_until = time.monotonic() + self.args.request_timeout_s
        while self.in_flight and time.monotonic() < wait_until:
            await asyncio.sleep(0.1)
        fault["in_flight_at_restart"] = self.in_flight
        fault["restart_begin_s"] = self.now()
        fault["stopped_exit_code"] = await asyncio.to_thread(self.server.stop)
        fault["stopped_s"] = self.now()
        self.generation += 1
        try:
            await asyncio.to_thread(self.start_server)
        except ServerStartError as exc:
            fault["error"] = f"the restart failed: {exc}"[:2000]
            log(f"  ! {fault['error']}")
        else:
            fault["restart_ready_s"] = self.now()
            self.generation_start_s.append(fault["restart_ready_s"])
            log(f"[{self.now():7.1f}s] server restarted in {fault['restart_ready_s'] - fault['restart_begin_s']:.1f}"
                f" s (stopping it took {fault['stopped_s'] - fault['restart_begin_s']:.1f} s)")
        self.serving.set()

    # ---- the run ------------------------------------------------------------------------------------------
    async def drive(self) -> dict:
        limits = httpx.Limits(max_connections=self.args.clients + 4, max_keepalive_connections=self.args.clients)
        async with httpx.AsyncClient(base_url=self.url, limits=limits) as client:
            self.t0 = time.monotonic()
            self.serving.set()
            tasks = [asyncio.create_task(self.client_loop(client, c)) for c in range(self.args.clients)]
            tasks.append(asyncio.create_task(self.malformed_loop(client)))
            helpers = [asyncio.create_task(self.sample_loop(client)), asyncio.create_task(self.window_loop(client))]
            fault = asyncio.create_task(self.fault_loop(client)) if self.args.tensor_parallel_size > 1 else None
            await asyncio.gather(*tasks)
            if fault is not None and self.faults:
                await fault  # a worker was killed: the end state is read from the restarted server
            for h in helpers + ([fault] if fault else []):  # a fault still to come ends with the traffic
                h.cancel()
            await asyncio.gather(*helpers, *([fault] if fault else []), return_exceptions=True)
            self.serving.set()
            traffic_end = self.now()
            end = await self.drained(client)
            self.boundaries = self.boundaries[:self.args.num_windows]
            self.boundaries += [{}] * (self.args.num_windows - len(self.boundaries)) + [end]
            self.print_window(len(self.boundaries) - 2)
            final = await self.take_sample(client, " end")
            try:
                health = (await client.get("/health", timeout=10)).status_code
            except httpx.HTTPError:
                health = None
        return {"traffic_end_s": round(traffic_end, 1), "health": health, "final_sample": final,
                "kv_blocks_free": end.get("onecat:kv_blocks_free"),
                "kv_blocks_total": end.get("onecat:kv_blocks_total"),
                "running": end.get("vllm:num_requests_running"), "waiting": end.get("vllm:num_requests_waiting")}

    async def drained(self, client: httpx.AsyncClient, timeout_s: float = 60.0) -> dict:
        """/metrics once nothing runs or waits (or after `timeout_s`)."""
        deadline = time.monotonic() + timeout_s
        while True:
            m = await self.scrape(client)
            if (m.get("vllm:num_requests_running") == 0 and m.get("vllm:num_requests_waiting") == 0) \
                    or time.monotonic() > deadline:
                return m
            await asyncio.sleep(0.2)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=20.0, help="traffic duration")
    ap.add_argument("--window-minutes", type=float, default=5.0, help="summary window (rounded to split the run "
                                                                      "into equal windows)")
    ap.add_argument("--clients", type=int, default=4, help="requests in flight (1..8)")
    ap.add_argument("--max-tokens", type=int, nargs=2, default=[16, 128], metavar=("LO", "HI"))
    ap.add_argument("--malformed-interval-s", type=float, default=5.0,
                    help="one malformed request every this many seconds, besides the clients' traffic")
    ap.add_argument("--sample-seconds", type=float, default=10.0, help="RSS and /metrics sampling period")
    ap.add_argument("--rss-baseline-minute", type=float, default=5.0,
                    help="RSS growth is measured from here (at most a quarter of the run) to the end")
    ap.add_argument("--tensor-parallel-size", type=int, default=1)
    ap.add_argument("--kill-minute", type=float, default=None,
                    help="with tensor parallel: when to kill a worker rank (default: mid-run)")
    ap.add_argument("--fault-probe-seconds", type=float, default=10.0,
                    help="traffic kept on the broken server before the restart")
    ap.add_argument("--fault-deadline-s", type=float, default=10.0,
                    help="each request after the kill must be answered within this")
    ap.add_argument("--request-timeout-s", type=float, default=300.0,
                    help="a request without an answer by then counts as lost")
    ap.add_argument("--model", default=EMBEDDED)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-dir", default=".onecat/benchmarks/soak_cpu")
    ap.add_argument("--out", default="benchmarks/results/soak_cpu.json")
    args = ap.parse_args(argv)
    if args.minutes <= 0 or args.window_minutes <= 0:
        ap.error("--minutes and --window-minutes must be > 0")
    if not 1 <= args.clients <= 8:
        ap.error(f"--clients {args.clients}: keep 1..8 requests in flight so the machine stays responsive")
    lo, hi = args.max_tokens
    if not 1 <= lo <= hi or hi >= args.max_model_len // 2:
        ap.error(f"--max-tokens {lo} {hi}: need 1 <= LO <= HI < max_model_len/2")
    if args.malformed_interval_s <= 0:
        ap.error("--malformed-interval-s must be > 0")
    if args.tensor_parallel_size < 1:
        ap.error("--tensor-parallel-size must be >= 1")
    if args.kill_minute is not None and args.tensor_parallel_size == 1:
        ap.error("--kill-minute needs --tensor-parallel-size > 1 (a worker rank to kill)")
    if args.tensor_parallel_size > 1:
        args.kill_minute = args.minutes / 2 if args.kill_minute is None else args.kill_minute
        if not 0 < args.kill_minute < args.minutes:
            ap.error(f"--kill-minute {args.kill_minute} must fall inside the run (0, {args.minutes})")
    args.num_windows = round(args.minutes / args.window_minutes)
    if args.num_windows < 2:
        ap.error(f"--window-minutes {args.window_minutes} leaves fewer than 2 windows in {args.minutes} minutes; the "
                 "TTFT drift compares the first window with the last: use --window-minutes <= minutes / 2")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    soak = Soak(args)
    mach = machine()
    log(f"soak: {args.minutes} min, {args.num_windows} windows, {args.clients} clients, TP={args.tensor_parallel_size}"
        f" on {mach['cpu_model']} ({mach['cores']} cores); server: {' '.join(soak.argv)}")
    soak.start_server()
    try:
        end = asyncio.run(soak.drive())
    finally:
        exit_code = soak.server.stop() if soak.server else None
    windows = summarise_windows(soak.outcomes, soak.boundaries, soak.window_s, args.num_windows)
    verdicts = Verdicts(soak.outcomes, soak.samples, windows, end, soak.faults, soak.generation_start_s, args)
    record = {
        "benchmark": "soak_cpu", "started_at": started,
        "finished_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "git": git_revision(), "machine": mach | {"load_average_after": os.getloadavg()},
        "settings": {k: v for k, v in vars(args).items()} | {"server_argv": soak.argv, "window_s": soak.window_s,
                                                             "prefix_caching": True, "speculative_config": NGRAM},
        "targets": verdicts.targets, "passed": verdicts.passed,
        "totals": totals(soak.outcomes), "windows": windows, "end_state": end | {"server_exit_code": exit_code},
        "faults": soak.faults, "samples": soak.samples,
        "server_logs": [str(Path(args.log_dir) / f"onecat_serve_{g}.log") for g in range(soak.generation + 1)],
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    for name, t in verdicts.targets.items():
        log(f"{t['verdict']:4s} {name}: {t['detail']}")
    log(f"{'PASS' if verdicts.passed else 'FAIL'}: record in {args.out}")
    return 0 if verdicts.passed else 1


if __name__ == "__main__":
    sys.exit(main())
