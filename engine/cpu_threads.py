"""How many intra-op threads a CPU engine uses: the cores it may run on, less those other processes keep busy.

More OpenMP threads than free cores is the worst case for a decode step: each of its ~100 parallel regions
waits at a barrier for a thread the OS has descheduled. So the engine counts the cores in its affinity
mask, measures how busy the machine is right now (other processes' share of /proc/stat over a short
window, not the load average, which lags and counts this engine's own past work) and takes the cores
left, at least one. A `cpu_threads` setting or OMP_NUM_THREADS decides instead. The choice is made once,
when the engine starts, and reported by LLM.info().
"""
from __future__ import annotations

import os
import time

import torch

SAMPLE_S = 0.1  # 20 jiffies on 2 CPUs: busy cores to within 0.05


def available_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _cpu_ticks() -> tuple[int, int] | None:
    """(busy, total) jiffies of all CPUs, or None off Linux."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields) - idle, sum(fields)


def busy_cores_elsewhere(sample_s: float = SAMPLE_S) -> float | None:
    """Cores kept busy by other processes over the next sample_s seconds (None where it cannot be read)."""
    before, own_before = _cpu_ticks(), time.process_time()
    if before is None:
        return None
    time.sleep(sample_s)
    after, own = _cpu_ticks(), time.process_time() - own_before
    busy, total = after[0] - before[0], after[1] - before[1]
    if total <= 0:
        return None
    cpus = os.cpu_count() or 1
    return max(0.0, busy / total * cpus - own / sample_s)


def choose_cpu_threads(requested: int | None) -> dict:
    """Set torch's intra-op threads for a CPU engine; returns what was chosen and why."""
    cores = available_cores()
    if requested is not None:
        threads, why, busy = requested, "cpu_threads setting", None
    elif os.environ.get("OMP_NUM_THREADS"):
        threads, why, busy = torch.get_num_threads(), "OMP_NUM_THREADS", None
    else:
        busy = busy_cores_elsewhere()
        free = cores if busy is None else cores - int(busy + 0.5)
        threads = max(1, min(cores, free))
        why = "all available cores" if threads == cores else \
            f"{cores} available cores, {busy:.1f} kept busy by other processes"
    torch.set_num_threads(threads)
    return {"threads": threads, "available_cores": cores,
            "busy_cores_elsewhere": None if busy is None else round(busy, 2), "chosen_by": why}
