"""The soak benchmark's figures: RSS of a process, per-window summaries, run totals and the verdict per target.

Kept apart from the driver (soak_cpu.py) so that each figure is a plain function of what the run
collected: the outcomes of every request (soak_traffic.Outcome), the RSS samples, and /metrics scraped
at each window boundary.
"""
from __future__ import annotations

from collections import Counter
from pathlib import Path

from soak_traffic import answered_as_expected

RSS_GROWTH_MAX = 0.05
TTFT_DRIFT_MAX = 1.5
LOST = ("no_answer", "stream_broken")


def _proc_rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def _proc_children(pid: int) -> list[int]:
    kids: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        text = (task / "children").read_text().split()
        kids += [int(c) for c in text]
    return kids + [g for c in kids for g in _proc_children(c)]


def descendants(pid: int) -> list[tuple[int, str]]:
    """(pid, command line) of every process below `pid` (from /proc)."""
    out = []
    for kid in _proc_children(pid):
        try:
            out.append((kid, Path(f"/proc/{kid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()))
        except OSError:  # gone meanwhile
            pass
    return out


def process_rss_mib(pid: int) -> tuple[float, float]:
    """(RSS of `pid`, summed RSS of its descendants) in MiB: psutil where installed, else /proc; (0, 0) once the
    process is gone."""
    try:
        import psutil
    except ImportError:
        try:
            kids = sum(_proc_rss_kib(c) for c in _proc_children(pid))
            return round(_proc_rss_kib(pid) / 1024, 1), round(kids / 1024, 1)
        except (OSError, ValueError):
            return 0.0, 0.0
    try:
        proc = psutil.Process(pid)
        kids = sum(c.memory_info().rss for c in proc.children(recursive=True))
        return round(proc.memory_info().rss / 2**20, 1), round(kids / 2**20, 1)
    except psutil.Error:
        return 0.0, 0.0


def pct(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (None for no values)."""
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


def counter_delta(before: dict | None, after: dict | None, name: str) -> float | None:
    """A Prometheus counter's increase; a restarted server's counter starts again from 0."""
    if not before or not after or name not in after:
        return None
    a, b = before.get(name, 0.0), after[name]
    return b if b < a else b - a


def _latency(outs: list) -> dict:
    return {"p50": pct(outs, 50), "p99": pct(outs, 99), "n": len(outs)}


def summarise_windows(outcomes: list, boundaries: list[dict], window_s: float, n: int) -> list[dict]:
    """Per window (by the time a request finished; the last window keeps what finished after the traffic
    stopped): requests, answers by status, TTFT/TPOT of streamed answers, tokens/s, and /metrics deltas."""
    windows = []
    for k in range(n):
        lo, hi = k * window_s, (k + 1) * window_s
        outs = [o for o in outcomes if lo <= o.finished_s and (o.finished_s < hi or k == n - 1)]
        normal = [o for o in outs if not o.fault]
        before = boundaries[k] if k < len(boundaries) else None
        after = boundaries[k + 1] if k + 1 < len(boundaries) else None
        hits = counter_delta(before, after, "vllm:prefix_cache_hits_total")
        queries = counter_delta(before, after, "vllm:prefix_cache_queries_total")
        shared = [o for o in normal if o.kind == "shared_prefix" and o.ok and o.cached_tokens is not None]
        tokens = sum(o.completion_tokens for o in normal if o.ok)
        windows.append({
            "index": k, "start_s": round(lo, 1), "end_s": round(hi, 1), "requests": len(outs),
            "by_status": dict(sorted(Counter(o.status_key for o in outs).items())),
            "malformed": sum(o.expect == "4xx" for o in outs), "disconnected": sum(o.disconnected for o in outs),
            "fault_requests": len(outs) - len(normal),
            "ttft_s": _latency([o.ttft_s for o in normal if o.stream and o.ttft_s is not None]),
            "tpot_s": _latency([o.tpot_s for o in normal if o.stream and o.ok and o.tpot_s is not None]),
            "completion_tokens": tokens, "tokens_per_s": tokens / window_s,
            "prefix_cache": {"hit_tokens": hits, "query_tokens": queries,
                             "hit_rate": hits / queries if hits is not None and queries else None,
                             "shared_prefix_answers_with_cached_tokens": sum(o.cached_tokens > 0 for o in shared),
                             "shared_prefix_answers_checked": len(shared)},
            "ngram": {"drafts": counter_delta(before, after, "vllm:spec_decode_num_drafts_total"),
                      "draft_tokens": counter_delta(before, after, "vllm:spec_decode_num_draft_tokens_total"),
                      "accepted_tokens": counter_delta(before, after, "vllm:spec_decode_num_accepted_tokens_total")},
        })
    return windows


def totals(outcomes: list) -> dict:
    normal = [o for o in outcomes if not o.fault]
    checked = [o for o in normal if o.expect == "4xx" or o.kind == "unknown_field"]
    uncached = [o for o in normal if o.kind != "shared_prefix" and o.ok and o.cached_tokens is not None]
    shared = [o for o in normal if o.kind == "shared_prefix" and o.ok and o.cached_tokens is not None]
    return {
        "requests": len(outcomes), "by_status": dict(sorted(Counter(o.status_key for o in outcomes).items())),
        "by_kind": dict(sorted(Counter(o.kind for o in outcomes).items())),
        "streamed": sum(o.stream for o in outcomes), "disconnected_on_purpose": sum(o.disconnected for o in outcomes),
        "num_5xx": sum(o.is_5xx for o in normal), "lost_answers": sum(o.status_key in LOST for o in normal),
        "fault_requests": len(outcomes) - len(normal), "completion_tokens": sum(o.completion_tokens for o in normal),
        "malformed_and_unknown_field_checked": len(checked),
        "malformed_answered_4xx": sum(o.expect == "4xx" and answered_as_expected(o) for o in checked),
        "checks_failed": [{"kind": o.kind, "path": o.path, "status": o.status_key, "error": o.error}
                          for o in checked if not answered_as_expected(o)][:20],
        "non_streamed_with_cached_tokens": {"shared_prefix": f"{sum(o.cached_tokens > 0 for o in shared)}"
                                                             f"/{len(shared)}",
                                            "unique_or_repetitive": f"{sum(o.cached_tokens > 0 for o in uncached)}"
                                                                    f"/{len(uncached)}"},
    }


class Verdicts:
    """PASS/FAIL per target, each with the value measured and a line saying what it compared."""

    def __init__(self, outcomes, samples, windows, end, faults, generation_start_s, args):
        self.targets: dict[str, dict] = {}
        normal = [o for o in outcomes if not o.fault]
        n5 = sum(o.is_5xx for o in normal)
        self.add("no_5xx", n5 == 0, n5, "0", f"{n5} answers with a 5xx status or a 5xx error event")
        lost = sum(o.status_key in LOST for o in normal)
        self.add("no_lost_answers", lost == 0, lost, "0", f"{lost} requests refused, reset, timed out or cut short")
        self.malformed(normal)
        self.rss(samples, generation_start_s, args.rss_baseline_minute)
        free, total = end.get("kv_blocks_free"), end.get("kv_blocks_total")
        idle = end.get("running") == 0 and end.get("waiting") == 0
        self.add("kv_blocks_free", total is not None and free == total and idle, {"free": free, "total": total},
                 "free == total", f"{free}/{total} KV blocks free after the traffic; running {end.get('running')}, "
                                  f"waiting {end.get('waiting')}")
        first, last = windows[0]["ttft_s"]["p99"], windows[-1]["ttft_s"]["p99"]
        ratio = last / first if first and last is not None else None
        self.add("ttft_p99_drift", ratio is not None and ratio <= TTFT_DRIFT_MAX, ratio, f"<= {TTFT_DRIFT_MAX}",
                 f"p99 TTFT last window {_ms(last)} vs first {_ms(first)}")
        if args.tensor_parallel_size > 1:
            self.fault(outcomes, faults, args.fault_deadline_s)
        self.passed = all(t["verdict"] == "PASS" for t in self.targets.values())

    def add(self, name: str, ok: bool, value, target: str, detail: str) -> None:
        self.targets[name] = {"verdict": "PASS" if ok else "FAIL", "value": value, "target": target, "detail": detail}

    def malformed(self, normal: list) -> None:
        checked = [o for o in normal if o.expect == "4xx" or o.kind == "unknown_field"]
        bad = [o for o in checked if not answered_as_expected(o)]
        sent = sum(o.expect == "4xx" for o in checked)
        worst = ", ".join(f"{o.kind} -> {o.status_key}" for o in bad[:3])
        self.add("malformed_4xx", sent > 0 and not bad, {"checked": len(checked), "wrong": len(bad)},
                 "every malformed request 4xx + OpenAI error body; unknown field 200",
                 f"{len(checked) - len(bad)}/{len(checked)} as expected ({sent} malformed)" + (f"; {worst}" if bad
                                                                                           else ""))

    def rss(self, samples: list[dict], generation_start_s: list[float], baseline_minute: float) -> None:
        """From the baseline minute of the last server process (a quarter of its life if shorter) to the end."""
        gen = len(generation_start_s) - 1
        mine = [s for s in samples if s["generation"] == gen and s["rss_mib"]]
        if len(mine) < 2:
            self.add("rss_growth", False, None, f"<= {RSS_GROWTH_MAX:.0%}", "fewer than 2 RSS samples")
            return
        start, end = generation_start_s[gen], mine[-1]
        offset = min(baseline_minute * 60, (end["t_s"] - start) / 4)
        base = next(s for s in mine if s["t_s"] >= start + offset)
        growth = end["rss_mib"] / base["rss_mib"] - 1
        self.add("rss_growth", growth <= RSS_GROWTH_MAX, round(growth, 4), f"<= {RSS_GROWTH_MAX:.0%}",
                 f"RSS {base['rss_mib']:.1f} MiB at {base['t_s']:.0f} s -> {end['rss_mib']:.1f} MiB at "
                 f"{end['t_s']:.0f} s ({growth:+.1%})")

    def fault(self, outcomes: list, faults: list[dict], deadline_s: float) -> None:
        f = faults[0] if faults else {}
        if f.get("kill_s") is None:
            self.add("tp_fault", False, None, "5xx fast, then restart", f.get("error", "no worker was killed"))
            return
        hit = [o for o in outcomes if o.fault]
        failed = [o for o in hit if o.is_5xx]
        shaped = all(o.error_code is not None and o.error_code >= 500 and (o.status == 200 or o.openai_error_body)
                     for o in failed)
        slowest = max((o.finished_s - max(o.started_s, f["kill_s"]) for o in hit), default=None)
        lost = sum(o.status_key in LOST for o in hit)
        after = [o for o in outcomes if o.generation == f["generation"] + 1 and o.ok and o.expect == "ok"]
        ok = (bool(failed) and shaped and lost == 0 and slowest is not None and slowest <= deadline_s
              and "restart_ready_s" in f and bool(after))
        restart = _s(f["restart_ready_s"] - f["restart_begin_s"]) if "restart_ready_s" in f else "none"
        self.add("tp_fault", ok, {"failed_5xx": len(failed), "lost": lost, "slowest_answer_s": slowest,
                                  "ok_after_restart": len(after)},
                 f"5xx OpenAI errors within {deadline_s} s, then restart",
                 f"{len(failed)} 5xx ({'OpenAI bodies' if shaped else 'NOT all OpenAI bodies'}), {lost} lost, "
                 f"slowest {_s(slowest)} after the kill; restart {restart}; {len(after)} ok after; "
                 f"/health after kill: {f.get('health_after_kill')}")


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{1000 * v:.0f} ms"


def _s(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f} s"
