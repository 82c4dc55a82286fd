"""`onecat gate run`: contract -> preflight -> both arms' workloads -> gates -> verdict -> report.

1. load and validate the contract, and refuse one whose own numbers make its requests impossible
   (prompt + output > an arm's max_model_len; ContractError: exit 2)
2. preflight, before loading anything: every workload kind has a runner, every dataset resolves
   with its pin, each arm's engine backend is available and its model files exist
   (PreflightError lists everything missing and where it looked: exit 4)
3. a run row is created (or, with --resume, the unfinished run of the same contract fingerprint is
   reopened); units already finished are skipped, a cut-short unit is redone from scratch
4. units run in schedule order: throughput series interleave A/B/A...A, other units run baseline then
   candidate; engines open lazily (both kept open when execution.interleave, else arm after arm)
5. gates are evaluated from the stored rows and held to the failed requests of the workloads they judge
   (gates/failures.py: a failed request is never evidence), the verdict stored, the report written
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from onecat.gates import registry
from onecat.gates.baseline_reuse import record_arm_evidence
from onecat.gates.checks.base import INCONCLUSIVE, CheckResult, Evidence
from onecat.gates.contract import ARM_NAMES, ArmSettings, Contract, load_feasible_contract, pin_code
from onecat.gates.datasets import DatasetError, ResolvedDataset, resolve_dataset
from onecat.gates.engines.base import Engine, EngineAdapter
from onecat.gates.failures import hold_to_failures, judged_workloads
from onecat.gates.revision.resolve import resolve_arm_code
from onecat.gates.runners.base import Unit
from onecat.gates.verdict import Verdict, decide
from onecat.results.environment import capture_environment
from onecat.results.records import RunRecord, new_run_id
from onecat.results.revision import engine_revision, git_revision, onecat_version
from onecat.results.sink import RunSink
from onecat.results.store import Store


class PreflightError(RuntimeError):
    """The contract cannot run on this machine; lists every missing piece and where it was looked for."""

    def __init__(self, contract: str, problems: list[str]):
        self.problems = problems
        super().__init__(f"contract {contract} cannot run here ({len(problems)} problem"
                         f"{'s' * (len(problems) != 1)}); nothing was loaded:\n"
                         + "\n".join("  - " + p.replace("\n", "\n      ") for p in problems))


class ResumeError(RuntimeError):
    pass


@dataclass
class Step:
    arm: str
    workload_id: str
    unit: Unit
    position: int = 0


@dataclass
class GateOutcome:
    run_id: str
    verdict: Verdict
    results: list[tuple[Any, CheckResult]]
    report_path: Optional[Path]
    wall_s: float
    steps_run: int = 0
    steps_skipped: int = 0
    warnings: list = dataclasses.field(default_factory=list)


# --------------------------------------------------------------------------- preflight
def preflight(contract: Contract) -> tuple[dict[str, ArmSettings], dict[str, ResolvedDataset]]:
    registry.load_plugins()
    problems: list[str] = []
    for w in contract.workloads:
        if w.kind not in registry.RUNNERS:
            problems.append(f"workload {w.id!r}: kind {w.kind!r} has no runner in this build (its schema is "
                            f"known, the runner is not installed); runners: {', '.join(sorted(registry.RUNNERS))}")
    datasets: dict[str, ResolvedDataset] = {}
    for name in sorted({d for w in contract.workloads for d in w.datasets()}):
        ref = contract.datasets.get(name)
        try:
            datasets[name] = resolve_dataset(name, ref.path if ref else None, sha256=ref.sha256 if ref else None,
                                             url=ref.url if ref else None)
        except DatasetError as exc:
            problems.append(str(exc))
    arms, code_problems = resolve_arm_code(contract, {a: contract.arm(a) for a in ARM_NAMES}, Path.cwd())
    problems += code_problems
    for a, arm in arms.items():
        engine_cls = engine_class(arm)
        if engine_cls is None:
            problems.append(f"arm {a}: unknown engine backend {arm.engine.backend!r}")
            continue
        for p in engine_cls.check(arm):
            problems.append(f"arm {a}: {p}")
    if problems:
        raise PreflightError(contract.name, _dedupe_problems(problems))
    return arms, datasets


def engine_class(arm: ArmSettings) -> Optional[type]:
    """The adapter that runs `arm`: its backend's, or a revision worker when the run resolved its code."""
    if arm.code is not None:
        from onecat.gates.engines.revision_engine import RevisionEngine

        return RevisionEngine
    return registry.ENGINES.get(arm.engine.backend)


def open_arm_engine(arm: ArmSettings, seed: int = 0) -> EngineAdapter:
    if arm.code is not None:
        return engine_class(arm).open(arm, seed)
    from onecat.gates.engines.base import open_engine

    return open_engine(arm, seed)


def _dedupe_problems(problems: list[str]) -> list[str]:
    seen, out = set(), []
    for p in problems:
        body = p.split(": ", 1)[1] if p.startswith("arm ") else p
        if body in seen:
            continue
        seen.add(body)
        out.append(p)
    return out


# --------------------------------------------------------------------------- schedule
def build_schedule(contract: Contract) -> list[Step]:
    steps: list[Step] = []
    for w in contract.workloads:
        runner = registry.RUNNERS[w.kind]()
        units = runner.plan(w, contract.sampling, list(contract.seeds))
        series: dict[str, list[Unit]] = {}
        for u in units:
            if u.interleave:
                series.setdefault(u.series or u.key, []).append(u)
        for name, us in series.items():
            us.sort(key=lambda u: u.repeat or 0)
            for u in us:
                steps += [Step("baseline", w.id, u), Step("candidate", w.id, u)]
            last = us[-1]
            rep = (last.repeat or 0) + 1
            steps.append(Step("baseline", w.id, dataclasses.replace(last, key=f"{name}/rep={rep}", repeat=rep)))
        plain = [u for u in units if not u.interleave]
        steps += [Step("baseline", w.id, u) for u in plain] + [Step("candidate", w.id, u) for u in plain]
    if not contract.execution.interleave:
        steps.sort(key=lambda s: ARM_NAMES.index(s.arm))  # stable: keeps order within an arm
    for i, s in enumerate(steps):
        s.position = i
    return steps


# --------------------------------------------------------------------------- sink
class StoreSink(RunSink):
    """The runners' Sink (gates.runners.base): RunSink plus the datasets resolved in preflight."""

    def __init__(self, store: Store, run_id: str, arm: str, workload_id: str, unit_key: str, position: int,
                 datasets: dict[str, ResolvedDataset], advance: Callable[[int], None]):
        super().__init__(store, run_id, arm, workload_id, unit_key, position, advance)
        self._datasets = datasets

    def dataset(self, name: str) -> ResolvedDataset:
        if name not in self._datasets:
            raise KeyError(f"dataset {name!r} was not resolved in preflight; a workload must list the datasets it "
                           "reads in WorkloadBase.datasets()")
        return self._datasets[name]


# --------------------------------------------------------------------------- run
class NullProgress:
    def start(self, total: int, done: int) -> None: ...
    def describe(self, text: str) -> None: ...
    def advance(self, n: int) -> None: ...
    def stop(self) -> None: ...


def run_gate(contract_path: str | Path, db: str | Path, resume: bool | str = False,
             report_dir: Optional[str | Path] = None, progress: Any = None,
             open_engine: Optional[Callable[[ArmSettings, int], Engine]] = None,
             reuse_baseline: bool = False, code_refs: Optional[dict[str, Optional[str]]] = None) -> GateOutcome:
    """Run a contract end to end; see the module docstring. `resume`: True (latest unfinished run of this
    contract) or a run id. `reuse_baseline`: copy the baseline's deterministic evidence from an earlier run
    (gates/baseline_reuse.py). `code_refs`: arm -> git revision its engine code runs (overrides the contract's
    `arms.<arm>.code`; gates/revision/). Raises ContractError, PreflightError, ResumeError, or the engine's
    errors (RevisionError when a revision's engine cannot run)."""
    if resume and reuse_baseline:
        raise ResumeError("--reuse-baseline decides what to copy when a run starts; a resumed run continues as it "
                          "started: drop --reuse-baseline (or start a new run without --resume)")
    from onecat.reports.markdown import write_report

    t0 = time.perf_counter()
    progress = progress or NullProgress()
    opener = open_engine or open_arm_engine
    contract = pin_code(load_feasible_contract(contract_path), code_refs or {})
    arms, datasets = preflight(contract)
    store = Store(db)
    try:
        warnings: list[str] = list(store.warnings)  # e.g. runs the store lost to a truncated write-ahead log
        run_id = _open_run(store, contract, str(contract_path), arms, datasets, resume, warnings)
        steps = build_schedule(contract)
        if not resume:
            record_arm_evidence(store, run_id, contract, arms, {n: d.sha256 for n, d in datasets.items()}, steps,
                                reuse_baseline, warnings)
        done = store.done_units(run_id)
        todo = [s for s in steps if (s.arm, s.workload_id, s.unit.key) not in done]
        total = sum(s.unit.size for s in steps)
        progress.start(total, total - sum(s.unit.size for s in todo))
        engines: dict[str, Engine] = {}
        runners = {w.id: registry.RUNNERS[w.kind]() for w in contract.workloads}
        last_step_of_arm = {s.arm: i for i, s in enumerate(todo)}
        try:
            with store.recording_stops(run_id, "interrupted by the user; continue with --resume"):
                for i, step in enumerate(todo):
                    if step.arm not in engines:
                        progress.describe(f"{step.arm}: opening engine")
                        engines[step.arm] = opener(arms[step.arm], contract.seeds[0])
                        store.add_environment(run_id, step.arm, capture_environment(engines[step.arm].info()))
                    w = contract.workload(step.workload_id)
                    progress.describe(f"{step.arm} · {w.id} · {step.unit.key}")
                    store.restart_unit(run_id, step.arm, w.id, step.unit.key)
                    sink = StoreSink(store, run_id, step.arm, w.id, step.unit.key, step.position, datasets,
                                     progress.advance)
                    runners[w.id].run_unit(engines[step.arm], w, contract.sampling, step.unit, sink)
                    store.finish_unit(run_id, step.arm, w.id, step.unit.key, step.position)
                    if not contract.execution.interleave and last_step_of_arm.get(step.arm) == i:
                        engines.pop(step.arm).close()
        finally:
            for eng in engines.values():
                try:
                    eng.close()
                except Exception:  # noqa: BLE001 - closing must not hide the real error
                    pass
            progress.stop()
        results = evaluate_gates(store, run_id, contract)
        verdict = decide(contract.gates, [r for _, r in results])
        store.set_verdict(run_id, verdict.decision, verdict.reason)
        store.set_status(run_id, "complete")
        report = write_report(store, run_id, report_dir)
        return GateOutcome(run_id, verdict, results, report, time.perf_counter() - t0, len(todo),
                           len(steps) - len(todo), warnings)
    finally:
        store.close()


def _open_run(store: Store, contract: Contract, path: str, arms: dict[str, ArmSettings],
              datasets: dict[str, ResolvedDataset], resume: bool | str, warnings: list[str]) -> str:
    if resume:
        run_id = store.latest_unfinished(contract.fingerprint) if resume is True else store.resolve_run_id(str(resume))
        if run_id is None:
            lost = [r["run_id"] for r in store.lost_runs if r.get("contract_fingerprint") == contract.fingerprint]
            why = (f"; run {', '.join(lost)} of this contract was lost (the store's write-ahead log was truncated), "
                   "so it cannot be resumed" if lost else "")
            raise ResumeError(f"--resume: no unfinished run of contract {contract.name} (fingerprint "
                              f"{contract.fingerprint[:12]}) in {store.path}{why}; start one without --resume")
        row = store.run(run_id)
        if row["contract_fingerprint"] != contract.fingerprint:
            raise ResumeError(f"--resume: run {run_id} was made with a different contract (fingerprint "
                              f"{row['contract_fingerprint'][:12]} != {contract.fingerprint[:12]}); the contract "
                              "changed, start a new run")
        if row["status"] == "complete":
            raise ResumeError(f"--resume: run {run_id} is already complete")
        moved = [a for a in ARM_NAMES if row[f"{a}_fingerprint"] != arms[a].fingerprint]
        if moved:
            raise ResumeError(f"--resume: the {' and '.join(moved)} arm of run {run_id} ran other engine code or "
                              "settings than it would now (a ref that moved, or changed code); start a new run")
        now = git_revision()
        if "unknown" not in (now, row["harness_revision"]) and now.split("-")[0] != row["harness_revision"].split("-")[0]:
            warnings.append(f"run {run_id} was started at revision {row['harness_revision']} and resumed at {now}: "
                            "its rows may come from two code versions (start a new run for a clean comparison)")
        store.set_status(run_id, "running")
        return run_id
    run_id = new_run_id(contract.name)
    store.create_run(gate_run_record(run_id, contract, path, arms, {n: d.sha256 for n, d in datasets.items()},
                                     engine_revision(), git_revision(), onecat_version()))
    return run_id


def gate_run_record(run_id: str, contract: Contract, contract_path: Optional[str], arms: dict[str, ArmSettings],
                    dataset_sha256: dict[str, str], engine_rev: str, harness_rev: str, version: str) -> RunRecord:
    return RunRecord(run_id=run_id, kind="gate", contract_name=contract.name,
                     contract_fingerprint=contract.fingerprint, contract_json=contract.canonical_json(),
                     contract_path=contract_path, baseline_fingerprint=arms["baseline"].fingerprint,
                     candidate_fingerprint=arms["candidate"].fingerprint,
                     arm_settings={name: arm.model_dump(mode="json") for name, arm in arms.items()},
                     dataset_sha256=dataset_sha256, engine_revision=engine_rev, harness_revision=harness_rev,
                     onecat_version=version)


def evaluate_gates(store: Store, run_id: str, contract: Contract) -> list[tuple[Any, CheckResult]]:
    """Each gate's check, then held to the failed requests of the workloads it judges (gates/failures.py)."""
    ev = Evidence(store, run_id)
    store.clear_checks(run_id)
    out = []
    workload_ids = [w.id for w in contract.workloads]
    for i, gate in enumerate(contract.gates):
        check = registry.CHECKS[gate.check]()
        try:
            result = check.evaluate(ev, gate)
        except Exception as exc:  # noqa: BLE001 - a check that cannot compute is undecided, and says why
            result = CheckResult(INCONCLUSIVE, f"check could not be computed: {type(exc).__name__}: {exc}")
        result = hold_to_failures(result, ev, judged_workloads(gate, workload_ids))
        store.add_check(run_id, i, gate, result)
        out.append((gate, result))
    return out

