"""EvalPlus evaluation: reference outputs from the canonical solution, then differential testing of a
candidate against them on base and plus inputs, every program run in the sandbox.

Follows EvalPlus (evalplus/evaluate.py, evalplus/eval/__init__.py):
  * expected outputs = canonical solution's outputs on the same inputs (with its per-input time);
  * per-input time limit = max(MIN_TIME_LIMIT, GT_TIME_LIMIT_FACTOR * reference time);
  * output comparison: ==, the MBPP/HumanEval special oracles, float tolerance via np.allclose
    (rtol 1e-7, atol from the task, 1e-6 once a float output was seen and the task's atol is 0);
  * pass@1 base = all base inputs pass; plus pass = base pass and all plus inputs pass.
Reference outputs are cached under .onecat/cache/evalplus/<dataset sha256>/<evaluator fingerprint>/
(0700: the sandbox uid must not read them even where it sees the host filesystem).
The program reports outputs over a result channel that the harness judges as it streams in; why a
solution cannot forge a pass there is in evalplus_protocol.py.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

from onecat.gates.sandbox import Channel, SandboxLimits, SandboxResult, SandboxUnavailable, run_python
from onecat.gates.tasks import pyvalues
from onecat.gates.tasks.evalplus_data import Problem
from onecat.gates.tasks.evalplus_driver import driver_program
from onecat.gates.tasks.evalplus_protocol import (PROTOCOL_ERROR, SETS, CandidateJudge, ChannelReader,
                                                  ReferenceCollector)

GT_TIME_LIMIT_FACTOR = 4.0
MIN_TIME_LIMIT = 1.0
TIMEOUT_CAP_S = 60.0          # EvalPlus caps one task's total time budget
LOAD_TIME_LIMIT_S = 10.0      # defining the solution (module-level code) may take this long
MEMORY_BYTES = 4 << 30        # EvalPlus's reliability guard allows 4 GiB
REFERENCE_WALL_S = 300.0
OUTPUT_CAP_BYTES = 64 << 10     # the program's stdout/stderr kept (diagnostics only)
REFERENCE_ROW_CAP = 64 << 20    # one reference output on the channel (HumanEval/130 has 12 MB rows)
CANDIDATE_ROW_FLOOR = 1 << 20   # a candidate row may be 8x the largest reference row, at least 1 MiB
CACHE_FORMAT = "2"

MBPP_OUTPUT_NOT_NONE_TASKS = ["check_str", "text_match_three", "text_starta_endb"]
MBPP_OUTPUT_SET_EQ_TASKS = ["similar_elements", "find_char_long", "common_in_nested_lists", "extract_singly",
                            "larg_nnum", "intersection_array", "find_dissimilar", "Diff"]


# ----------------------------------------------------------------------------- special oracles
def _poly(xs: list, x: float) -> float:
    return sum(coeff * math.pow(x, i) for i, coeff in enumerate(xs))


def _surface_area(base_edge, height):
    slant = math.sqrt((base_edge / 2) ** 2 + height ** 2)
    return round(base_edge ** 2 + 4 * (base_edge * slant) / 2)


def _digit_distance_nums(num1, num2):
    a, b = str(num1), str(num2)
    width = max(len(a), len(b))
    return sum(abs(int(x) - int(y)) for x, y in zip(a.zfill(width), b.zfill(width)))


def is_floats(x: Any) -> bool:
    if isinstance(x, float):
        return True
    if isinstance(x, (list, tuple)) and x:
        return all(isinstance(i, float) for i in x)
    if isinstance(x, np.ndarray):
        return x.dtype in (np.float64, np.float32)
    return False


class OutputComparator:
    """EvalPlus's per-input check for one task; stateful like upstream (atol sticks at 1e-6)."""

    def __init__(self, problem: Problem):
        self.dataset, self.entry_point, self.atol = problem.dataset, problem.entry_point, problem.atol

    def matches(self, inp: Sequence, out: Any, exp: Any) -> bool:
        try:
            return self._matches(inp, out, exp)
        except Exception:
            return False

    def _matches(self, inp, out, exp) -> bool:
        ep = self.entry_point
        exact = bool(out == exp)
        if self.dataset == "mbpp":
            if ep == "are_equivalent":
                exact = True
            elif ep == "sum_div":
                exact = exact or out == 0
            elif ep == "surface_Area":
                exact = exact or abs(out - _surface_area(*inp)) <= self.atol
            elif ep == "digit_distance_nums":
                exact = exact or out == _digit_distance_nums(*inp)
            elif ep in MBPP_OUTPUT_SET_EQ_TASKS:
                exact = set(out) == set(exp)
            elif ep in MBPP_OUTPUT_NOT_NONE_TASKS:
                exact = (out == exp) if isinstance(out, bool) else (exp == (out is not None))
        if self.dataset == "humaneval" and ep == "find_zero":
            return abs(_poly(*inp, out)) <= self.atol
        if self.atol == 0 and is_floats(exp):
            self.atol = 1e-6
        if not exact and self.atol != 0:
            if type(out) is not type(exp):
                return False
            if isinstance(exp, (list, tuple)) and len(out) != len(exp):
                return False
            return bool(np.allclose(out, exp, rtol=1e-07, atol=self.atol))
        return exact


# ----------------------------------------------------------------------------- sandbox runs
def _run_driver(problem: Problem, code: str, mode: str, time_limits: dict[str, list[float]] | None,
                wall_s: float, reader: ChannelReader) -> SandboxResult:
    """Run the driver on `code`; its result channel streams into `reader` (judged or collected)."""
    spec = {
        "mode": mode, "code": code, "entry_point": problem.entry_point, "order": list(SETS),
        "inputs": {name: [pyvalues.encode_value(x) for x in getattr(problem, f"{name}_input")] for name in SETS},
        "time_limits": {name: (time_limits or {}).get(name) for name in SETS},
        "load_time_limit": LOAD_TIME_LIMIT_S,
        "output_not_none": mode == "reference" and problem.dataset == "mbpp"
        and problem.entry_point in MBPP_OUTPUT_NOT_NONE_TASKS,
    }
    limits = SandboxLimits(cpu_s=wall_s, wall_s=wall_s, memory_bytes=MEMORY_BYTES, max_processes=8,
                           max_file_bytes=64 << 20, max_output_bytes=OUTPUT_CAP_BYTES)
    return run_python(driver_program(), limits, files={"spec.json": json.dumps(spec)}, guard="manual",
                      channel=Channel(reader.on_line, reader.max_line_bytes))


def _sizes(problem: Problem) -> dict[str, int]:
    return {name: len(getattr(problem, f"{name}_input")) for name in SETS}


@dataclass
class Reference:
    """Canonical outputs and times of one task (or why they could not be computed)."""

    task_id: str
    outputs: dict[str, list] = field(repr=False)
    times: dict[str, list[float]] = field(repr=False)
    error: str | None = None
    max_row_bytes: int = 0   # largest output row on the channel; bounds what a candidate may send

    def time_limits(self, factor: float = GT_TIME_LIMIT_FACTOR, floor: float = MIN_TIME_LIMIT) -> dict[str, list[float]]:
        return {name: [max(floor, factor * t) for t in ts] for name, ts in self.times.items()}

    @property
    def candidate_row_cap(self) -> int:
        return min(2 * REFERENCE_ROW_CAP, max(CANDIDATE_ROW_FLOOR, 8 * self.max_row_bytes))


def compute_reference(problem: Problem) -> Reference:
    """Run the canonical solution in the sandbox (trusted code, no per-input limit)."""
    collector = ReferenceCollector(_sizes(problem), REFERENCE_ROW_CAP)
    res = _run_driver(problem, problem.reference_code, "reference", None, REFERENCE_WALL_S, collector)
    error = None
    if not collector.complete:
        f = collector.failure
        error = (f"{f.reason} {f.failed_set}[{f.failed_index}]: {f.detail}" if f and f.failed_set else
                 f"{f.reason}: {f.detail}" if f else f"sandbox {res.describe()}: {res.stderr_text[-300:]}")
    return Reference(problem.task_id, collector.outputs, collector.times, error, collector.max_row_bytes)


@lru_cache(maxsize=1)
def _evaluator_fingerprint() -> str:
    """Cached outputs are only valid for the same driver/codec and sandbox interpreter."""
    from onecat.gates.sandbox.run import sandbox_python

    return hashlib.sha256((CACHE_FORMAT + "\0" + driver_program() + "\0" + sandbox_python()).encode()).hexdigest()[:16]


def _private_dirs(top: Path, leaf: Path) -> None:
    """Create `leaf` and every dir from `top` down to it as 0700 (existing ones are tightened)."""
    leaf.mkdir(mode=0o700, parents=True, exist_ok=True)
    for d in [leaf, *leaf.relative_to(top).parents]:
        path = d if d.is_absolute() else top / d
        if path.stat().st_uid == os.geteuid():
            os.chmod(path, 0o700)


class ReferenceCache:
    """Reference outputs per task, computed once per dataset file (keyed by its sha256).

    Everything from <cache>/evalplus down is 0700: on a machine where the sandbox sees the host
    filesystem, its uid still cannot replay the expected outputs from here."""

    def __init__(self, dataset_sha256: str, root: str | Path | None = None):
        base = Path(root) if root else Path(os.environ.get("ONECAT_CACHE_DIR", Path(".onecat") / "cache"))
        self.top = base / "evalplus"
        self.dir = self.top / dataset_sha256 / _evaluator_fingerprint()
        self._mem: dict[str, Reference] = {}

    def _path(self, task_id: str) -> Path:
        return self.dir / (hashlib.sha256(task_id.encode()).hexdigest()[:16] + ".json")

    def get(self, problem: Problem) -> Reference:
        if problem.task_id in self._mem:
            return self._mem[problem.task_id]
        path = self._path(problem.task_id)
        ref = None
        if path.is_file():
            try:
                data = json.loads(path.read_text())
                if data["task_id"] == problem.task_id:
                    ref = Reference(problem.task_id, {k: pyvalues.decode_value(v) for k, v in data["outputs"].items()},
                                    data["times"], data["error"], int(data["max_row_bytes"]))
            except (ValueError, KeyError, TypeError):
                ref = None
        if ref is None:
            ref = compute_reference(problem)
            if ref.error is None:  # failures are retried next time rather than cached
                _private_dirs(self.top, self.dir)
                tmp = path.with_suffix(f".{os.getpid()}.tmp")
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                with os.fdopen(fd, "w") as fh:
                    json.dump({"task_id": ref.task_id, "error": ref.error, "times": ref.times,
                               "max_row_bytes": ref.max_row_bytes,
                               "outputs": {k: pyvalues.encode_value(v) for k, v in ref.outputs.items()}}, fh)
                tmp.replace(path)
        self._mem[problem.task_id] = ref
        return ref


# ----------------------------------------------------------------------------- candidate check
@dataclass
class TaskOutcome:
    """One solution's EvalPlus result: pass@1 base/plus and, when it failed, why and where."""

    task_id: str
    base_pass: bool
    plus_pass: bool
    failure_reason: str | None = None   # no_code | load_error | load_timeout | error | timeout | wrong_answer
    #                                     | sandbox_protocol_error | sandbox_error | reference_error
    failed_set: str | None = None       # "base" | "plus"
    failed_index: int | None = None
    detail: str | None = None
    eval_s: float = 0.0
    sandbox: str = ""
    filesystem: str = ""                # what the program could see: fresh-root:<how> | host-fs-view

    def to_dict(self) -> dict:
        return asdict(self)


def check_solution(problem: Problem, code: str, reference: Reference, *,
                   factor: float = GT_TIME_LIMIT_FACTOR, floor: float = MIN_TIME_LIMIT) -> TaskOutcome:
    """Run `code` on base then plus inputs in the sandbox, each output compared as it arrives."""
    start = time.monotonic()
    if reference.error:
        return TaskOutcome(problem.task_id, False, False, "reference_error", detail=reference.error)
    if not code.strip():
        return TaskOutcome(problem.task_id, False, False, "no_code")
    limits = reference.time_limits(factor, floor)
    wall = min(TIMEOUT_CAP_S, sum(sum(v) for v in limits.values())) + LOAD_TIME_LIMIT_S + 5.0
    comparators = {name: OutputComparator(problem) for name in SETS}  # stateful per set, like upstream
    inputs = {name: getattr(problem, f"{name}_input") for name in SETS}

    def matches(name: str, i: int, out: Any) -> bool:
        return comparators[name].matches(inputs[name][i], out, reference.outputs[name][i])

    def describe(name: str, i: int, out: Any) -> str:
        return f"got {_short(out)}, expected {_short(reference.outputs[name][i])}"

    judge = CandidateJudge(_sizes(problem), reference.candidate_row_cap, matches, describe)
    res = _run_driver(problem, code, "candidate", limits, wall, judge)
    outcome = _verdict(problem.task_id, judge, res)
    outcome.eval_s = time.monotonic() - start
    outcome.sandbox = res.describe()
    outcome.filesystem = next((m for m in res.mechanisms if m.startswith(("fresh-root:", "host-fs-view"))), "")
    return outcome


def _verdict(tid: str, judge: CandidateJudge, res: SandboxResult) -> TaskOutcome:
    """The judge's first failure, or a pass once every row matched, or why rows are missing."""
    n_base = sum(1 for name, _ in judge.plan if name == "base")
    base_done = judge.position >= n_base
    if res.channel_error:
        return TaskOutcome(tid, False, False, PROTOCOL_ERROR, detail=res.channel_error)
    f = judge.failure
    if f is not None:
        base_pass = base_done and f.failed_set == "plus"
        return TaskOutcome(tid, base_pass, False, f.reason, f.failed_set, f.failed_index, f.detail)
    if judge.complete:
        return TaskOutcome(tid, True, True)
    killed = res.timed_out or res.signal is not None
    sandbox = f"sandbox {res.describe()}: {res.stderr_text[-300:]}"
    if judge.loaded is None:
        return TaskOutcome(tid, False, False, "timeout" if killed else "load_error", detail=sandbox)
    name, i = judge.plan[judge.position]
    return TaskOutcome(tid, base_done, False, "timeout" if killed else "error", name, i,
                       f"no result ({sandbox})")


def _short(x: Any) -> str:
    text = repr(x)
    return text if len(text) <= 120 else text[:117] + "..."


def check_many(jobs: Iterable[tuple[Problem, str]], cache: ReferenceCache, workers: int | None = None) -> list[TaskOutcome]:
    """check_solution over (problem, code) pairs in parallel sandboxes, in input order."""
    jobs = list(jobs)
    workers = workers or max(1, os.cpu_count() or 1)

    def one(job):
        problem, code = job
        try:
            return check_solution(problem, code, cache.get(problem))
        except SandboxUnavailable:
            raise  # the machine cannot run any program: say so, rather than fail every task
        except Exception as exc:  # a harness fault fails this task, never the chunk or the run
            return TaskOutcome(problem.task_id, False, False, "sandbox_error",
                               detail=f"{type(exc).__name__}: {str(exc)[:300]}")

    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(one, jobs))
