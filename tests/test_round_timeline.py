"""benchmarks/round_timeline.py's summary of a profiler trace, on a hand-made Chrome trace: the window starts at the
step of the first CUDA graph replay (an eager prefill before it is left out), idle gaps go to the host phase
running then, and each kernel's exclusive time leaves out what overlaps device work that started before it, so the
exclusive times add up to the busy time."""
from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _phase(name: str, ts: float, dur: float) -> dict:
    return {"cat": "user_annotation", "ph": "X", "name": name, "ts": ts, "dur": dur}


def _kernel(name: str, ts: float, dur: float, corr: int) -> dict:
    return {"cat": "kernel", "ph": "X", "name": name, "ts": ts, "dur": dur, "args": {"correlation": corr}}


def test_window_idle_and_exclusive_kernel_time(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from round_timeline import summarize

    events = [
        _phase("engine.step", 0, 1000), _phase("execute", 10, 900), _kernel("prefill_gemm", 20, 950, 1),
        # two decode steps replaying a graph; in each, kernel b starts early (PDL) and waits 20 us on a
        _phase("engine.step", 1000, 100), _phase("execute.replay", 1005, 10),
        _kernel("a", 1010, 50, 2), _kernel("b", 1040, 40, 2),  # busy 1010-1080
        _phase("engine.step", 1100, 100), _phase("execute.replay", 1105, 10), _phase("postprocess", 1180, 20),
        _kernel("a", 1110, 50, 3), _kernel("b", 1140, 40, 3),  # busy 1110-1180
        {"cat": "cuda_runtime", "ph": "X", "name": "cudaGraphLaunch", "ts": 1008, "dur": 2, "args": {"correlation": 2}},
        {"cat": "cuda_runtime", "ph": "X", "name": "cudaGraphLaunch", "ts": 1108, "dur": 2, "args": {"correlation": 3}},
    ]
    trace = tmp_path / "t.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    s = summarize(trace)
    assert s["steps"] == 2 and "first CUDA graph replay" in s["window"] and "left out: 1" in s["window"]
    assert s["wall_us"] == 200 and s["device_busy_us"] == 140
    assert s["device_per_step_us_top_kernels"] == {"a": 50.0, "b": 40.0}  # b's 20 us wait counted as b's
    assert s["device_exclusive_per_step_us_top_kernels"] == {"a": 50.0, "b": 20.0}  # adds up to the busy 70
    assert s["device_per_step_us_by_launching_phase"] == {"execute.replay": 90.0}
    # gaps 1000-1010 (in execute.replay at its midpoint), 1080-1110 (in the step only), 1180-1200 (in postprocess)
    assert s["idle_per_step_us_by_host_phase"] == {"engine.step": 15.0, "postprocess": 10.0, "execute.replay": 5.0}
