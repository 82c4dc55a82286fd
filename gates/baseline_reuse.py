"""`gate run --reuse-baseline`: copy the baseline arm's deterministic evidence from an earlier run.

A PR gate runs the same baseline (the merge base) again and again. Rows that are a pure function of the
arm's settings need not be regenerated: token hashes, PPL segments and task outcomes under greedy
decoding (which workloads count is each runner's call: `Runner.deterministic_evidence`). A baseline
workload's rows are copied from the newest earlier run when all of these hold:

- that run finished (status complete) and one of its arms has this baseline's fingerprint
  (model, engine, speculative settings; with a pinned code ref, the engine's commit)
- the workload is the same (its contract entry, the sampling block and the seeds are equal) and reads
  datasets with the same sha256
- the arm ran in the same environment class: device type and name, torch version, and the engine's
  code (commit plus a hash of uncommitted engine changes) unless the fingerprint already pins it
- that run finished every unit of the workload for the arm, and none of its requests failed

Speed evidence (throughput series, endpoint load) is never reused: it is measured fresh and interleaved.
Every new gate run records each arm's environment class (arm_outcomes.environment_class), so later runs
can reuse from it; the copied workloads and their source run are recorded (arm_outcomes.reused_evidence)
and shown in the report.
"""
from __future__ import annotations

import hashlib
import json
import subprocess
from collections import defaultdict
from typing import Any, Optional, Sequence

from onecat.gates import registry
from onecat.gates.contract import ArmSettings, Contract
from onecat.results.environment import capture_environment
from onecat.results.records import (ArmOutcome, Environment, ItemOutcome, Metric, RequestRecord, is_failed_request,
                                    record_from_row)
from onecat.results.revision import REPO_ROOT, UNKNOWN, engine_revision
from onecat.results.store import Store

REUSING_ARM = "baseline"


# --------------------------------------------------------------------------- environment class
def engine_code() -> Optional[str]:
    """The engine sources' commit, plus a hash of their uncommitted changes on a dirty tree; None when unknown."""
    rev = engine_revision()
    if rev == UNKNOWN:
        return None
    if rev.endswith("-dirty"):
        try:
            diff = subprocess.run(["git", "diff", "HEAD", "--", "engine", "csrc"], cwd=REPO_ROOT,
                                  capture_output=True, timeout=30, check=True).stdout
        except (OSError, subprocess.SubprocessError):
            return None
        rev += "-" + hashlib.sha256(diff).hexdigest()[:16]
    return rev


def environment_class(arm: ArmSettings, env: Environment, code: Optional[str]) -> dict[str, Any]:
    """What deterministic evidence of `arm` depends on beyond its fingerprint. A value of None (unknown)
    makes the class match nothing."""
    device = arm.engine.device
    if device == "auto":
        device = "cuda" if env.gpu_count else "cpu"
    device_type = device.split(":")[0]
    out = {"device": device_type, "device_name": env.gpu_name if device_type == "cuda" else env.cpu_model,
           "torch_version": env.torch_version}
    if getattr(arm, "code", None) is None:  # a pinned code ref puts the engine's commit in the fingerprint
        out["engine_code"] = code
    return out


def _complete(env_class: dict[str, Any]) -> bool:
    return bool(env_class) and all(v is not None for v in env_class.values())


# --------------------------------------------------------------------------- start of a run
def record_arm_evidence(store: Store, run_id: str, contract: Contract, arms: dict[str, ArmSettings],
                        dataset_sha256: dict[str, str], steps: Sequence[Any], reuse: bool,
                        warnings: list[str]) -> dict[str, dict[str, str]]:
    """At the start of a new gate run: record each arm's environment class and, with `reuse`, copy the
    baseline's deterministic evidence (finishing those units, so they are not run). `steps` is the run's
    schedule (gate_run.Step: arm, workload_id, unit, position). Returns workload -> {"run_id", "arm"} copied."""
    env, code = capture_environment(), engine_code()
    classes = {name: environment_class(arm, env, code) for name, arm in arms.items()}
    reused: dict[str, dict[str, str]] = {}
    if reuse:
        reused = _reuse_baseline(store, run_id, contract, arms[REUSING_ARM], dataset_sha256,
                                 classes[REUSING_ARM], steps, warnings)
    for name in arms:
        store.add_arm_outcome(run_id, name, ArmOutcome("ran", environment_class=classes[name],
                                                       reused_evidence=reused if name == REUSING_ARM else {}))
    return reused


def _reuse_baseline(store: Store, run_id: str, contract: Contract, arm: ArmSettings, dataset_sha256: dict[str, str],
                    env_class: dict[str, Any], steps: Sequence[Any], warnings: list[str]) -> dict[str, dict[str, str]]:
    if not _complete(env_class):
        warnings.append(f"--reuse-baseline: nothing reused, this machine's environment class is not fully known "
                        f"({env_class}); the baseline runs in full")
        return {}
    ours = json.loads(contract.canonical_json())
    donors = _donors(store, run_id, arm.fingerprint)
    reused: dict[str, dict[str, str]] = {}
    for index, workload in enumerate(contract.workloads):
        units = [s for s in steps if s.arm == REUSING_ARM and s.workload_id == workload.id]
        runner = registry.RUNNERS[workload.kind]()
        if not units or any(s.unit.interleave for s in units) or \
                not runner.deterministic_evidence(workload, contract.sampling):
            continue  # speed or sampled evidence: always measured fresh
        wanted = _Wanted(ours, ours["workloads"][index], {d: dataset_sha256.get(d) for d in workload.datasets()},
                         env_class, {s.unit.key for s in units})
        donor = next((d for d in donors if wanted.met_by(store, d, workload.id)), None)
        if donor is None:
            warnings.append(f"--reuse-baseline: workload {workload.id} runs on the baseline: no earlier complete "
                            f"run has its evidence for baseline fingerprint {arm.fingerprint[:12]} with the same "
                            "workload, sampling, seeds, datasets and environment class")
            continue
        _copy_workload(store, run_id, donor, workload.id, units)
        reused[workload.id] = {"run_id": donor["run_id"], "arm": donor["arm"]}
    return reused


# --------------------------------------------------------------------------- finding a donor
def _donors(store: Store, run_id: str, fingerprint: str) -> list[dict]:
    """Complete gate runs with an arm of this fingerprint, newest first: their row plus `arm` and the
    arm's recorded environment class."""
    _, rows = store.query("SELECT run_id, baseline_fingerprint, candidate_fingerprint FROM runs WHERE status ="
                          " 'complete' AND coalesce(kind, 'gate') = 'gate' AND run_id <> ? AND ? IN"
                          " (baseline_fingerprint, candidate_fingerprint) ORDER BY started_at DESC",
                          [run_id, fingerprint])
    out = []
    for rid, base_fp, cand_fp in rows:
        run = store.run(rid)
        classes = {o["arm"]: json.loads(o["environment_class_json"] or "{}") for o in store.arm_outcomes(rid)}
        for arm_name, fp in (("baseline", base_fp), ("candidate", cand_fp)):
            if fp == fingerprint:
                out.append({**run, "arm": arm_name, "environment_class": classes.get(arm_name, {})})
    return out


class _Wanted:
    """What a donor run must match for one workload's baseline evidence."""

    def __init__(self, contract: dict, workload: dict, dataset_sha256: dict[str, Optional[str]],
                 env_class: dict[str, Any], unit_keys: set[str]):
        self.contract, self.workload, self.dataset_sha256 = contract, workload, dataset_sha256
        self.env_class, self.unit_keys = env_class, unit_keys

    def met_by(self, store: Store, donor: dict, workload_id: str) -> bool:
        theirs = json.loads(donor["contract_json"])
        donor_sha = json.loads(donor["dataset_sha256_json"] or "{}")
        if (self.workload not in theirs.get("workloads", []) or theirs.get("sampling") != self.contract["sampling"]
                or theirs.get("seeds") != self.contract["seeds"] or donor["environment_class"] != self.env_class
                or any(donor_sha.get(name) != sha for name, sha in self.dataset_sha256.items())):
            return False
        done = {key for arm, wl, key in store.done_units(donor["run_id"]) if arm == donor["arm"] and wl == workload_id}
        if not self.unit_keys <= done:
            return False
        return not any(is_failed_request(r) for r in store.requests(donor["run_id"], donor["arm"], workload_id))


# --------------------------------------------------------------------------- copying
def _copy_workload(store: Store, run_id: str, donor: dict, workload_id: str, units: Sequence[Any]) -> None:
    """The donor arm's rows of one workload, written as this run's baseline rows, then its units finished."""
    src, arm = donor["run_id"], donor["arm"]
    for row in store.requests(src, arm, workload_id):
        store.add_request(run_id, REUSING_ARM, workload_id, record_from_row(RequestRecord, row), row["unit_key"])
    measures: dict[tuple, dict] = defaultdict(dict)
    first_row: dict[tuple, dict] = {}
    for row in store.items(src, arm, workload_id):
        key = (row["item_id"], row["seed"])
        measures[key][row["measure"]] = row["passed"]
        first_row.setdefault(key, row)
    for key, row in first_row.items():
        seed = None if row["seed"] == -1 else row["seed"]
        store.add_item(run_id, REUSING_ARM, workload_id,
                       record_from_row(ItemOutcome, row, passed=measures[key], seed=seed), row["request_key"])
    positions = {step.unit.key: step.position for step in units}
    for row in store.metrics(src, arm, workload_id):
        store.add_metric(run_id, REUSING_ARM, workload_id, record_from_row(Metric, row), row["unit_key"],
                         positions.get(row["unit_key"], row["position"]))
    env = [e for e in store.environment(src) if e["arm"] == arm]
    if env and not any(e["arm"] == REUSING_ARM for e in store.environment(run_id)):
        store.add_environment(run_id, REUSING_ARM, record_from_row(Environment, env[0]))  # replaced if it opens
    for key, position in positions.items():
        store.finish_unit(run_id, REUSING_ARM, workload_id, key, position)
