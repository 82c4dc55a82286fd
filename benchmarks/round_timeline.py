"""Where a decode step's or a speculative round's wall time goes on a GPU: the device's busy time, and each
stretch in which the device sat idle charged to the host phase that was running then.

`phase_marks()` wraps the engine's host phases (scheduling, proposing, the drafter's context flush and graph,
the step's launch, verification and its read-back, post-processing) in profiler ranges for as long as the
block runs; `summarize(trace)` reads the Chrome trace that torch.profiler exported and reports, over the
window of the engine steps: wall time, device-busy time (the union of kernel, copy and set intervals), and the
idle gaps by the innermost phase active on the host at the gap (`(none)`: between phases, e.g. the
generate loop itself). A gap inside a phase that waits on the device (a read-back) cannot happen: the device
is busy then; gaps are host work that the device waited for. CPU and device times in a Kineto trace share one
clock, so a gap's host phase is read at its midpoint. Device time is also split by the host phase that
launched it (the runtime call's correlation id: drafter vs verify work) and by kernel name, plainly and exclusive
of the time a kernel overlaps device work that started before it (under programmatic dependent launch a kernel
starts early and waits: its plain time counts the wait). Where the steps replay CUDA graphs, the window starts at
the step of the first replay, so an eager prefill before it does not land in the per-step figures.
"""
from __future__ import annotations

import bisect
import contextlib
import json
from collections import defaultdict
from pathlib import Path

import torch

DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
STEP_PHASE = "engine.step"
REPLAY_PHASE = "execute.replay"
TOP_KERNELS = 25
KERNEL_NAME_CHARS = 90


def _targets():
    """(owner, attribute, phase name) of every host phase that is marked."""
    from onecat.engine.core.decode_pipeline import DecodePipeline
    from onecat.engine.core.engine_core import EngineCore
    from onecat.engine.speculative.base import SpeculativeDecoder
    from onecat.engine.speculative.dflash import DFlashProposer
    from onecat.engine.speculative.dflash_cache import DrafterKVCache
    from onecat.engine.speculative.dflash_graphs import DrafterGraphs
    from onecat.engine.speculative.mtp import MTPProposer
    from onecat.engine.worker.cuda_graph import DecodeGraphs
    from onecat.engine.worker.worker import Worker

    return [(EngineCore, "step", STEP_PHASE), (EngineCore, "_schedule", "schedule"),
            (SpeculativeDecoder, "lookahead", "propose"), (DrafterKVCache, "flush", "drafter.flush"),
            (DrafterGraphs, "run", "drafter.graph"), (DFlashProposer, "draft_logits", "drafter.logits"),
            (Worker, "execute", "execute"), (DecodeGraphs, "replay_step", REPLAY_PHASE),
            (EngineCore, "_verify", "verify"), (EngineCore, "postprocess", "postprocess"),
            (SpeculativeDecoder, "step_done", "gate"), (DFlashProposer, "record_features", "drafter.record"),
            (MTPProposer, "record_features", "drafter.record"), (MTPProposer, "_draft", "drafter.mtp"),
            (DecodePipeline, "_launch", "pipeline.launch"), (DecodePipeline, "_apply", "pipeline.apply")]


@contextlib.contextmanager
def phase_marks():
    """Wrap the marked methods in torch.profiler.record_function for the block; restored afterwards."""
    saved = []
    for owner, attr, name in _targets():
        original = owner.__dict__[attr]

        def marked(*a, _f=original, _name=name, **kw):
            with torch.profiler.record_function(_name):
                return _f(*a, **kw)

        saved.append((owner, attr, original))
        setattr(owner, attr, marked)
    try:
        yield
    finally:
        for owner, attr, original in saved:
            setattr(owner, attr, original)


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def summarize(trace_path: Path, min_gap_us: float = 2.0) -> dict:
    """Wall, device-busy and idle-by-host-phase times (microseconds) over the trace's engine steps."""
    events = json.loads(Path(trace_path).read_text())["traceEvents"]
    phases = [e for e in events if e.get("cat") == "user_annotation" and e.get("ph") == "X"]
    steps = sorted((e for e in phases if e["name"] == STEP_PHASE), key=lambda e: e["ts"])
    if not steps:
        raise ValueError(f"{trace_path} holds no {STEP_PHASE!r} ranges: profile inside phase_marks()")
    all_steps = len(steps)
    replays = [e["ts"] for e in phases if e["name"] == REPLAY_PHASE]
    if replays:  # from the step of the first graph replay: the eager prefill before it is another kind of step
        first = min(replays)
        steps = [e for e in steps if e["ts"] + e["dur"] >= first]
    t0 = min(e["ts"] for e in steps)
    t1 = max(e["ts"] + e["dur"] for e in steps)
    device = _union([(e["ts"], e["ts"] + e["dur"]) for e in events
                     if e.get("cat") in DEVICE_CATEGORIES and e.get("ph") == "X" and e["ts"] + e["dur"] > t0
                     and e["ts"] < t1])
    busy = sum(min(b, t1) - max(a, t0) for a, b in device)
    gaps, at = [], t0
    for a, b in device:
        if a > at:
            gaps.append((at, min(a, t1)))
        at = max(at, b)
    if at < t1:
        gaps.append((at, t1))
    # innermost phase at a time: the shortest range containing it
    phases.sort(key=lambda e: e["ts"])
    starts = [e["ts"] for e in phases]
    idle_by_phase: dict[str, float] = defaultdict(float)
    for a, b in gaps:
        if b - a < min_gap_us:
            idle_by_phase["(gaps < %g us)" % min_gap_us] += b - a
            continue
        idle_by_phase[_innermost(phases, starts, (a + b) / 2)] += b - a
    host_by_phase: dict[str, float] = defaultdict(float)
    for e in phases:
        host_by_phase[e["name"]] += e["dur"]
    by_launch, by_kernel, exclusive = _device_time_by_launch(events, phases, starts, t0, t1)
    n = len(steps)
    window = ("from the step of the first CUDA graph replay (steps before it, the prefill's, left out: "
              f"{all_steps - n})" if replays else "every engine step")
    return {"steps": n, "window": window, "wall_us": round(t1 - t0, 1), "device_busy_us": round(busy, 1),
            "wall_per_step_us": round((t1 - t0) / n, 1), "device_busy_per_step_us": round(busy / n, 1),
            "idle_per_step_us_by_host_phase": {k: round(v / n, 1) for k, v in
                                               sorted(idle_by_phase.items(), key=lambda kv: -kv[1])},
            "host_per_step_us_by_phase": {k: round(v / n, 1) for k, v in
                                          sorted(host_by_phase.items(), key=lambda kv: -kv[1])},
            "device_per_step_us_by_launching_phase": {k: round(v / n, 1) for k, v in
                                                      sorted(by_launch.items(), key=lambda kv: -kv[1])},
            "device_per_step_us_top_kernels": {k: round(v / n, 1) for k, v in
                                               sorted(by_kernel.items(), key=lambda kv: -kv[1])[:TOP_KERNELS]},
            # each kernel's time less what overlaps kernels that started before it (a kernel launched early under
            # programmatic dependent launch waits at its start while the one before runs): these add up to the
            # busy time, where the plain sums above count a wait as the waiting kernel's
            "device_exclusive_per_step_us_top_kernels": {k: round(v / n, 1) for k, v in sorted(
                exclusive.items(), key=lambda kv: -kv[1])[:TOP_KERNELS]}}


def _innermost(phases: list[dict], starts: list[float], t: float) -> str:
    inner, width = "(none)", float("inf")
    for e in phases[:bisect.bisect_right(starts, t)]:
        if e["ts"] + e["dur"] >= t and e["dur"] < width:
            inner, width = e["name"], e["dur"]
    return inner


def _device_time_by_launch(events: list[dict], phases: list[dict], starts: list[float], t0: float,
                           t1: float) -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
    """Device time in [t0, t1] by the host phase whose runtime call (kernel launch, graph launch, copy) started
    it, matched through the trace's correlation ids; by kernel name (a graph's kernels by their own names); and by
    kernel name exclusive of the time it overlaps device work that started before it."""
    launched_at = {e["args"]["correlation"]: e["ts"] for e in events
                   if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})}
    by_launch: dict[str, float] = defaultdict(float)
    by_kernel: dict[str, float] = defaultdict(float)
    exclusive: dict[str, float] = defaultdict(float)
    covered = t0  # device work so far runs until here
    for e in sorted((e for e in events if e.get("cat") in DEVICE_CATEGORIES and e.get("ph") == "X"
                     and t0 <= e["ts"] < t1), key=lambda e: e["ts"]):
        at = launched_at.get(e.get("args", {}).get("correlation"))
        by_launch["(unmatched)" if at is None else _innermost(phases, starts, at)] += e["dur"]
        name = e["name"][:KERNEL_NAME_CHARS]
        by_kernel[name] += e["dur"]
        end = min(e["ts"] + e["dur"], t1)
        exclusive[name] += max(0.0, end - max(e["ts"], covered))
        covered = max(covered, end)
    return by_launch, by_kernel, exclusive


def profile_steps(run, out: Path, label: str) -> dict:
    """Run `run()` under torch.profiler with the phases marked; write the trace's summary (and return it)."""
    out.mkdir(parents=True, exist_ok=True)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    trace = out / f"{label}.trace.json"
    with phase_marks(), torch.profiler.profile(activities=activities) as prof:
        run()
    prof.export_chrome_trace(str(trace))
    summary = summarize(trace)
    trace.unlink()  # large; the summary is what is kept
    return summary
