"""Reading a contract: file -> YAML (reader.py) -> sizes (limits.py) -> schema (model.py) -> cross-checks
(checks.py). Every problem, however hostile the file, is one ContractError listing them all.

Contracts are untrusted input. The file is read by reader.py (size, encoding, anchors, nesting,
numbers), sizes are bounded by limits.py (raised only by an explicit `limits:` block), and values
are validated strictly: `true` is not 1, `8.0` is not 8, and a setting the engine would ignore (an
empty stop string, top_p under greedy decoding) is refused. Each workload and gate is validated
against the schema registered for its `kind` / `check`, with the same error reporting.

    load_contract(path) -> Contract                 # raises ContractError (never anything else)
    parse_contract(data: dict, source="<dict>", lines=None) -> Contract
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import ValidationError

from onecat.gates import registry
from onecat.gates.contract.checks import cross_checks
from onecat.gates.contract.errors import ContractError, ContractIssue, dedupe, issue_at, issues_from_validation
from onecat.gates.contract.limits import DEFAULT_LIMITS, ContractLimits, size_problems
from onecat.gates.contract.model import ARM_NAMES, ArmSpec, Contract
from onecat.gates.contract.reader import load_yaml, read_contract_text
from onecat.gates.contract.settings import EngineSpec, ModelSpec


def load_contract(path: str | Path) -> Contract:
    """Read, parse and validate a contract file. Every problem, however hostile the file, is a ContractError."""
    p, source = Path(path), str(path)
    if not p.is_file():
        raise ContractError(source, [ContractIssue(path="", message="file not found" if not p.exists()
                                                   else "not a file")])
    try:
        data, lines = load_yaml(read_contract_text(p, source), source)
        return parse_contract(data, source=source, lines=lines)
    except RecursionError:  # the reader bounds nesting; this is the last line of defence
        raise ContractError(source, [ContractIssue(path="", message="nested too deeply to read")]) from None
    except OSError as exc:
        raise ContractError(source, [ContractIssue(path="", message=f"cannot be read: {exc.strerror or exc}")]) \
            from None


def parse_contract(data: Any, source: str = "<contract>", lines: dict[tuple, int] | None = None) -> Contract:
    """Validate a contract dict: sizes against the limits, the shared schema, then each workload/gate
    against its registered schema. Validation is strict (no bool/float/str coercion to numbers)."""
    registry.load_plugins()
    lines = lines or {}
    if not isinstance(data, dict):
        raise ContractError(source, [ContractIssue(path="", line=1, message=f"a contract is a mapping of keys, "
                                                                            f"got {type(data).__name__}")])
    limits, issues = _limits_of(data, lines)
    issues += [issue_at(path, message, lines) for path, message in size_problems(data, limits)]
    try:
        contract = Contract.model_validate(data, strict=True)
    except ValidationError as exc:
        issues += issues_from_validation(exc, data, lines, (), Contract)
        # keep going on the typed parts so one run reports as much as possible
        contract = None
    typed_w, typed_g = [], []
    for section, table, what, out in (("workloads", registry.WORKLOAD_SCHEMAS, "kind", typed_w),
                                      ("gates", registry.CHECKS, "check", typed_g)):
        items = data.get(section)
        if not isinstance(items, list):
            continue
        for i, item in enumerate(items):
            if not isinstance(item, dict) or not isinstance(item.get(what), str):
                continue  # already reported by the shared schema
            name = item[what]
            schema = table.get(name)
            if schema is not None and section == "gates":
                schema = schema.Config
            if schema is None:
                known = ", ".join(sorted(table)) or "(none)"
                broken = "".join(f"; {m} failed to import: {e}" for m, e in registry.PLUGIN_ERRORS.items())
                issues.append(ContractIssue(path=f"{section}[{i}].{what}", line=lines.get((section, i, what)),
                                            message=f"unknown {what} {name!r}; known: {known}{broken}"))
                continue
            try:
                out.append(schema.model_validate(item, strict=True))
            except ValidationError as exc:
                issues += issues_from_validation(exc, data, lines, (section, i), schema)
    if contract is not None and not issues:
        contract = contract.model_copy(update={"workloads": typed_w, "gates": typed_g})
        issues += _arm_issues(contract, data, lines)
    if contract is not None and not issues:
        issues += cross_checks(contract, lines)
    if issues:
        raise ContractError(source, dedupe(issues))
    return contract


def _limits_of(data: dict, lines: dict[tuple, int]) -> tuple[ContractLimits, list[ContractIssue]]:
    """The contract's own `limits:` block over the defaults (defaults, and its issues, when it is invalid)."""
    block = data.get("limits")
    if block is None:
        return DEFAULT_LIMITS, []
    try:
        return ContractLimits.model_validate(block, strict=True), []
    except ValidationError as exc:
        return DEFAULT_LIMITS, issues_from_validation(exc, data, lines, ("limits",), ContractLimits)


def _arm_issues(c: Contract, data: dict, lines: dict[tuple, int]) -> list[ContractIssue]:
    """Overrides are checked field by field on their own; the merged settings must validate too
    (e.g. bounds such as max_num_seqs >= 1 apply to the effective value)."""
    issues: list[ContractIssue] = []
    for a in ARM_NAMES:
        over: ArmSpec = getattr(c.arms, a)
        for section, spec, base in (("model", ModelSpec, c.model), ("engine", EngineSpec, c.engine)):
            part = getattr(over, section)
            if part is None:
                continue
            try:
                spec.model_validate({**base.model_dump(), **part.model_dump(exclude_none=True)}, strict=True)
            except ValidationError as exc:
                issues += issues_from_validation(exc, data, lines, ("arms", a, section), spec)
    return issues
