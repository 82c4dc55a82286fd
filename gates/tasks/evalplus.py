"""EvalPlus evaluation: reference outputs from the canonical solution, then differential testing of a
candidate against them on base and plus inputs, every program run in the sandbox.

Follows EvalPlus (evalplus/evaluate.py, evalplus/eval/__init__.py):
  * expected outputs = canonical solution's outputs on the same inputs (with its per-input time);
  * per-input time limit = max(MIN_TIME_LIMIT, GT_TIME_LIMIT_FACTOR * reference time);
  * output comparison: ==, the MBPP/HumanEval special oracles, float tolerance via np.allclose
    (rtol 1e-7, atol from the task, 1e-6 once a float output was seen and the task's atol is 0);
  * pass@1 base = all base inputs pass; plus pass = base pass and all plus inputs pass.
Reference outputs are cached under .onecat/cache/evalplus/<dataset sha256>/<evaluator fingerprint>/.
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

from onecat.gates.sandbox import SandboxLimits, run_python
from onecat.gates.tasks import pyvalues
from onecat.gates.tasks.evalplus_data import Problem
from onecat.gates.tasks.evalplus_driver import driver_program

GT_TIME_LIMIT_FACTOR = 4.0
MIN_TIME_LIMIT = 1.0
TIMEOUT_CAP_S = 60.0          # EvalPlus caps one task's total time budget
LOAD_TIME_LIMIT_S = 10.0      # defining the solution (module-level code) may take this long
MEMORY_BYTES = 4 << 30        # EvalPlus's reliability guard allows 4 GiB
REFERENCE_WALL_S = 300.0

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
@dataclass
class _RunLog:
    load: dict | None
    rows: dict[str, list[dict]]
    done: bool
    sandbox: Any


def _run_driver(problem: Problem, code: str, mode: str, time_limits: dict[str, list[float]] | None,
                order: Sequence[str], wall_s: float) -> _RunLog:
    spec = {
        "mode": mode, "code": code, "entry_point": problem.entry_point, "order": list(order),
        "inputs": {name: [pyvalues.encode_value(x) for x in getattr(problem, f"{name}_input")] for name in order},
        "time_limits": {name: (time_limits or {}).get(name) for name in order},
        "load_time_limit": LOAD_TIME_LIMIT_S,
        "output_not_none": mode == "reference" and problem.dataset == "mbpp"
        and problem.entry_point in MBPP_OUTPUT_NOT_NONE_TASKS,
    }
    limits = SandboxLimits(cpu_s=wall_s, wall_s=wall_s, memory_bytes=MEMORY_BYTES, max_processes=8,
                           max_file_bytes=64 << 20, max_output_bytes=1 << 30)
    res = run_python(driver_program(), limits, files={"spec.json": json.dumps(spec)}, guard="manual")
    load, rows, done = None, {name: [] for name in order}, False
    for line in res.stdout.splitlines():
        try:
            msg = json.loads(line)
        except ValueError:
            break  # a solution that scribbled on the channel only loses its own remaining rows
        if not isinstance(msg, dict):
            break
        if msg.get("event") == "load":
            load = msg
        elif msg.get("event") == "done":
            done = True
        elif msg.get("set") in rows:
            rows[msg["set"]].append(msg)
    return _RunLog(load, rows, done, res)


@dataclass
class Reference:
    """Canonical outputs and times of one task (or why they could not be computed)."""

    task_id: str
    outputs: dict[str, list] = field(repr=False)
    times: dict[str, list[float]] = field(repr=False)
    error: str | None = None

    def time_limits(self, factor: float = GT_TIME_LIMIT_FACTOR, floor: float = MIN_TIME_LIMIT) -> dict[str, list[float]]:
        return {name: [max(floor, factor * t) for t in ts] for name, ts in self.times.items()}


def compute_reference(problem: Problem) -> Reference:
    """Run the canonical solution in the sandbox (trusted code, no per-input limit)."""
    log = _run_driver(problem, problem.reference_code, "reference", None, ("base", "plus"), REFERENCE_WALL_S)
    outputs = {k: [pyvalues.decode_value(r["out"]) for r in rows if r["status"] == "ok"] for k, rows in log.rows.items()}
    times = {k: [r["t"] for r in rows if r["status"] == "ok"] for k, rows in log.rows.items()}
    error = None
    if not log.done:
        bad = [r for rows in log.rows.values() for r in rows if r["status"] != "ok"]
        error = (f"load {log.load}" if not log.load or log.load.get("status") != "ok" else
                 f"{bad[0]['set']}[{bad[0]['i']}] {bad[0]['status']} {bad[0].get('error', '')}" if bad else
                 f"sandbox {log.sandbox.describe()}: {log.sandbox.stderr_text[-300:]}")
    return Reference(problem.task_id, outputs, times, error)


@lru_cache(maxsize=1)
def _evaluator_fingerprint() -> str:
    """Cached outputs are only valid for the same driver/codec and sandbox interpreter."""
    from onecat.gates.sandbox.run import sandbox_python

    return hashlib.sha256((driver_program() + "\0" + sandbox_python()).encode()).hexdigest()[:16]


class ReferenceCache:
    """Reference outputs per task, computed once per dataset file (keyed by its sha256)."""

    def __init__(self, dataset_sha256: str, root: str | Path | None = None):
        base = Path(root) if root else Path(os.environ.get("ONECAT_CACHE_DIR", Path(".onecat") / "cache"))
        self.dir = base / "evalplus" / dataset_sha256 / _evaluator_fingerprint()
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
                                    data["times"], data["error"])
            except (ValueError, KeyError):
                ref = None
        if ref is None:
            ref = compute_reference(problem)
            if ref.error is None:  # failures are retried next time rather than cached
                self.dir.mkdir(parents=True, exist_ok=True)
                tmp = path.with_suffix(".tmp")
                tmp.write_text(json.dumps({"task_id": ref.task_id, "error": ref.error, "times": ref.times,
                                           "outputs": {k: pyvalues.encode_value(v) for k, v in ref.outputs.items()}}))
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
    failed_set: str | None = None       # "base" | "plus"
    failed_index: int | None = None
    detail: str | None = None
    eval_s: float = 0.0
    sandbox: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


def check_solution(problem: Problem, code: str, reference: Reference, *,
                   factor: float = GT_TIME_LIMIT_FACTOR, floor: float = MIN_TIME_LIMIT) -> TaskOutcome:
    """Run `code` on base then plus inputs in the sandbox and compare with the reference outputs."""
    start = time.monotonic()
    if reference.error:
        return TaskOutcome(problem.task_id, False, False, "reference_error", detail=reference.error)
    if not code.strip():
        return TaskOutcome(problem.task_id, False, False, "no_code")
    limits = reference.time_limits(factor, floor)
    wall = min(TIMEOUT_CAP_S, sum(sum(v) for v in limits.values())) + LOAD_TIME_LIMIT_S + 5.0
    log = _run_driver(problem, code, "candidate", limits, ("base", "plus"), wall)
    outcome = _judge(problem, reference, log)
    outcome.eval_s = time.monotonic() - start
    outcome.sandbox = log.sandbox.describe()
    return outcome


def _judge(problem: Problem, reference: Reference, log: _RunLog) -> TaskOutcome:
    tid = problem.task_id
    if log.load is None:
        return TaskOutcome(tid, False, False, "timeout" if log.sandbox.timed_out or log.sandbox.signal else "load_error",
                           detail=f"sandbox {log.sandbox.describe()}: {log.sandbox.stderr_text[-300:]}")
    if log.load.get("status") != "ok":
        return TaskOutcome(tid, False, False, "load_timeout" if log.load.get("status") == "timeout" else "load_error",
                           detail=log.load.get("error"))
    passed = {}
    for name in ("base", "plus"):
        comparator = OutputComparator(problem)
        inputs, expected, rows = getattr(problem, f"{name}_input"), reference.outputs[name], log.rows[name]
        for i, exp in enumerate(expected):
            if i >= len(rows):
                why = "timeout" if (log.sandbox.timed_out or log.sandbox.signal) else "error"
                return _fail(tid, passed, why, name, i, f"no result (sandbox {log.sandbox.describe()})")
            row = rows[i]
            if row.get("status") != "ok":
                why = row.get("status") if row.get("status") in ("error", "timeout") else "error"
                return _fail(tid, passed, why, name, i, row.get("error"))
            try:
                out = pyvalues.decode_value(row["out"])
            except Exception:
                return _fail(tid, passed, "error", name, i, "malformed result row from the sandbox")
            if not comparator.matches(inputs[i], out, exp):
                return _fail(tid, passed, "wrong_answer", name, i, f"got {_short(out)}, expected {_short(exp)}")
        passed[name] = True
    return TaskOutcome(tid, True, True)


def _fail(tid, passed, why, name, i, detail) -> TaskOutcome:
    return TaskOutcome(tid, passed.get("base", False), False, why, name, i, detail)


def _short(x: Any) -> str:
    text = repr(x)
    return text if len(text) <= 120 else text[:117] + "..."


def check_many(jobs: Iterable[tuple[Problem, str]], cache: ReferenceCache, workers: int | None = None) -> list[TaskOutcome]:
    """check_solution over (problem, code) pairs in parallel sandboxes, in input order."""
    jobs = list(jobs)
    workers = workers or max(1, os.cpu_count() or 1)

    def one(job):
        problem, code = job
        return check_solution(problem, code, cache.get(problem))

    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(one, jobs))
