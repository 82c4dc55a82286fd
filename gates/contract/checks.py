"""Checks of a typed contract that span its sections, and the edits made to it on the command line.

parse_contract (load.py) runs `cross_checks` once the schema is satisfied: workload ids and
datasets, gates naming workloads, registered backends, engine options against EngineArgs, pinned code.
`contract_warnings` lists what is legal but suspicious; `pin_code` applies --baseline-ref /
--candidate-ref.
"""
from __future__ import annotations

from collections import Counter
from typing import Optional

from pydantic import ValidationError

from onecat.engine.args import describe_errors
from onecat.gates import registry
from onecat.gates.contract.errors import ContractError, ContractIssue, dedupe
from onecat.gates.contract.model import ARM_NAMES, Arms, ArmSpec, Contract
from onecat.gates.contract.settings import CodeSpec
from onecat.gates.datasets import known_dataset


def cross_checks(c: Contract, lines: dict[tuple, int]) -> list[ContractIssue]:
    issues = []
    ids = [w.id for w in c.workloads]
    id_counts = Counter(ids)
    for i, w in enumerate(c.workloads):
        if id_counts[w.id] > 1:
            issues.append(ContractIssue(path=f"workloads[{i}]", line=lines.get(("workloads", i)),
                                        message=f"workload id {w.id!r} is used twice; give each a distinct `name`"))
        for ds in w.datasets():
            if ds not in c.datasets and not known_dataset(ds):
                issues.append(ContractIssue(
                    path=f"workloads[{i}].dataset", line=lines.get(("workloads", i, "dataset")),
                    message=f"unknown dataset {ds!r}; registered: {', '.join(sorted(registry.DATASETS))}; "
                            f"or declare it under `datasets: {{{ds}: {{path: ..., sha256: ...}}}}`"))
    for name, ref in c.datasets.items():
        if not known_dataset(name) and (ref.path is None and ref.url is None or ref.sha256 is None):
            issues.append(ContractIssue(path=f"datasets.{name}", line=lines.get(("datasets", name)),
                                        message="a dataset the registry does not know needs `sha256` and "
                                                "`path` or `url`"))
    for i, g in enumerate(c.gates):
        wl = getattr(g, "workload", None)
        if wl is not None and wl not in ids:
            issues.append(ContractIssue(path=f"gates[{i}].workload", line=lines.get(("gates", i, "workload")),
                                        message=f"no workload with id {wl!r}; workload ids: {', '.join(ids)}"))
    issues += _near_tie_issues(c, lines)
    for scope, eng in [("engine", c.engine)] + [(f"arms.{a}.engine", c.arm(a).engine) for a in ARM_NAMES]:
        if eng.backend not in registry.ENGINES:
            key = tuple(scope.split(".")) + ("backend",)
            issues.append(ContractIssue(path=f"{scope}.backend", line=lines.get(key) or lines.get(("engine", "backend")),
                                        message=f"unknown engine backend {eng.backend!r}; registered: "
                                                f"{', '.join(sorted(registry.ENGINES))}{_backend_hint(eng.backend)}"))
    issues += _engine_args_issues(c, lines)
    issues += code_issues(c, lines)
    return dedupe(issues)


def _near_tie_issues(c: Contract, lines: dict[tuple, int]) -> list[ContractIssue]:
    """token_hash_equal's near_tie reads each step's top-2 logprobs of a greedy determinism workload."""
    issues = []
    by_id = {w.id: w for w in c.workloads}
    for i, g in enumerate(c.gates):
        if getattr(g, "check", "") != "token_hash_equal" or getattr(g, "near_tie", None) is None:
            continue
        w = by_id.get(g.workload) if g.workload else None
        where = dict(path=f"gates[{i}].near_tie", line=lines.get(("gates", i, "near_tie")) or lines.get(("gates", i)))
        if g.compare != "arms":
            issues.append(ContractIssue(**where, message="near_tie applies to compare: arms only"))
        elif c.sampling.temperature > 0:
            issues.append(ContractIssue(**where, message="near_tie compares greedy choices; set sampling.temperature 0"))
        elif w is None or getattr(w, "top_logprobs", 0) < 2:
            issues.append(ContractIssue(**where, message="near_tie needs the steps' top-2 logprobs: point `workload` "
                                                         "at a determinism workload with `top_logprobs: 2`"))
    return issues


def code_issues(c: Contract, lines: dict[tuple, int] | None = None) -> list[ContractIssue]:
    """A pinned engine revision runs the in-process onecat engine in a worker: when any arm pins code, both
    arms must use backend onecat (the other arm runs the working tree through the same worker path)."""
    if not c.pins_code:
        return []
    lines = lines or {}
    return [ContractIssue(path=f"arms.{a}.engine.backend", line=lines.get(("arms", a, "code")) or lines.get(("arms", a)),
                          message=f"backend {c.arm(a).engine.backend!r} cannot run pinned engine code: `code: "
                                  f"{{ref: ...}}` (or --baseline-ref/--candidate-ref) runs the onecat engine of a "
                                  f"git revision, so both arms need backend onecat; remove the ref or use onecat")
            for a in ARM_NAMES if c.arm(a).engine.backend != "onecat"]


def pin_code(c: Contract, refs: dict[str, Optional[str]], source: str = "command line") -> Contract:
    """The contract with `arms.<arm>.code.ref` set from `refs` (arm -> git revision; None leaves the arm
    as the contract has it): what --baseline-ref / --candidate-ref do. Raises ContractError."""
    given = {a: r for a, r in refs.items() if r is not None}
    unknown = sorted(set(given) - set(ARM_NAMES))
    if unknown:
        raise ValueError(f"unknown arm(s) {unknown}; arms are {ARM_NAMES}")
    if not given:
        return c
    arms, issues = {}, []
    for a in ARM_NAMES:
        spec: ArmSpec = getattr(c.arms, a)
        if a in given:
            try:
                spec = spec.model_copy(update={"code": CodeSpec.model_validate({"ref": given[a]}, strict=True)})
            except ValidationError:
                issues.append(ContractIssue(path=f"--{a}-ref", message=f"{given[a]!r} is not a git revision name: "
                                            "give a branch, tag or commit (non-empty, no spaces, not starting "
                                            "with '-', at most 256 characters)"))
        arms[a] = spec
    pinned = c.model_copy(update={"arms": Arms(**arms)})
    issues += code_issues(pinned)
    if issues:
        raise ContractError(source, issues)
    return pinned


def _backend_hint(name: str) -> str:
    if "vllm" in name.lower():
        return ("; vLLM runs as backend vllm_serve (the harness starts `vllm serve` with the arm's settings; "
                "`onecat bench compare` sets it side by side with onecat)")
    return ""


def _engine_args_issues(c: Contract, lines: dict[tuple, int]) -> list[ContractIssue]:
    """Arms of a backend that runs onecat's EngineArgs: every `engine.options` key must be one of its
    settings, with a valid value (refused here, not as a TypeError when the engine opens)."""
    issues = []
    for a in ARM_NAMES:
        arm = c.arm(a)
        if not getattr(registry.ENGINES.get(arm.engine.backend), "takes_engine_args", False):
            continue
        over = getattr(c.arms, a).engine
        scope = ("arms", a, "engine") if over is not None and over.options is not None else ("engine",)
        try:
            arm.engine_args(c.seeds[0])
        except ValidationError as exc:
            message = describe_errors(exc, "engine setting")
        except ValueError as exc:
            message = str(exc)
        else:
            continue
        issues.append(ContractIssue(path=".".join(scope + ("options",)), message=message,
                                    line=lines.get(scope + ("options",)) or lines.get(scope)))
    return issues


def contract_warnings(c: Contract) -> list[str]:
    out = []
    arms_by_problem: dict[str, list[str]] = {}
    for a in ARM_NAMES:
        arm = c.arm(a)
        if getattr(registry.ENGINES.get(arm.engine.backend), "takes_engine_args", False):
            for problem in arm.engine_args(c.seeds[0]).unsupported():
                arms_by_problem.setdefault(problem, []).append(a)
    out += [f"the onecat engine cannot run arm {' and '.join(arms)}: {problem}"
            for problem, arms in arms_by_problem.items()]
    if c.arm("baseline").fingerprint == c.arm("candidate").fingerprint:
        out.append("arms.baseline and arms.candidate have identical effective settings (an A/A run)")
    if c.sampling.temperature > 0 and any(getattr(g, "check", "") == "token_hash_equal" for g in c.gates):
        out.append("token_hash_equal with temperature > 0 relies on per-request seeds being honoured")
    return out
