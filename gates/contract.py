"""The gate contract: what is compared (two arms), on which workloads, judged by which gates.

A contract is YAML validated into frozen pydantic models. Shared settings (model, engine,
speculative, sampling, seeds) hold for both arms; `arms.baseline` / `arms.candidate` override
only what differs (the fast path under test). Unknown keys are refused everywhere, and every
problem is reported as `FILE:LINE: key.path: what is wrong (what is allowed)`.

Contracts are untrusted input. The file is read by gates/contract_yaml.py (size, encoding,
anchors, nesting, numbers), sizes are bounded by gates/limits.py (raised only by an explicit
`limits:` block), and values are validated strictly: `true` is not 1, `8.0` is not 8, and a
setting the engine would ignore (an empty stop string, top_p under greedy decoding) is refused.

Workloads and gates are open sets: `kind` / `check` picks the pydantic schema registered for
it (a runner's `Workload`, a check's `Config`; see gates/registry.py), so a new runner or check
brings its own schema and the contract validates it with the same error reporting.

Public API (stable):
    load_contract(path) -> Contract                 # raises ContractError (never anything else)
    parse_contract(data: dict, source="<dict>", lines=None) -> Contract
    Contract.fingerprint                            # sha256 of canonical JSON (defaults filled in)
    Contract.canonical_json()
    Contract.arm("baseline" | "candidate") -> ArmSettings   # effective model/engine/speculative
    ArmSettings.fingerprint                         # sha256 of the arm's effective engine settings
Cross-field checks, warnings and pin_code (--baseline-ref / --candidate-ref) live in gates/contract_checks.py.
"""
from __future__ import annotations

import hashlib
import json
from collections import Counter
from pathlib import Path
from typing import Annotated, Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, SerializeAsAny, ValidationError, create_model, field_validator

from onecat.engine.args import EngineArgs
from onecat.gates import registry
from onecat.gates.contract_errors import ContractError, ContractIssue, dedupe, issue_at, issues_from_validation
# the shared settings live in their own module; importing them from here keeps working
from onecat.gates.contract_settings import (ENGINE_ARGS_IN_CONTRACT, ENGINE_OPTIONS, CodeRevision,  # noqa: F401
                                            CodeSpec, DatasetRef, EngineSpec, ExecutionSpec, ModelSpec,
                                            ReasoningSpec, SamplingSpec, SpeculativeSpec, Strict)
from onecat.gates.contract_yaml import load_yaml, read_contract_text
from onecat.gates.limits import DEFAULT_LIMITS, ContractLimits, size_problems

ARM_NAMES = ("baseline", "candidate")


# --------------------------------------------------------------------------- arms as overrides
def _partial(model: type[BaseModel], name: str) -> type[BaseModel]:
    """Same fields as `model` (their validation included), all optional: an arm names only the settings it
    changes."""
    fields = {k: (Optional[Annotated[(f.annotation, *f.metadata)]] if f.metadata else Optional[f.annotation], None)
              for k, f in model.model_fields.items()}
    return create_model(name, __base__=Strict, **fields)


ModelOverride = _partial(ModelSpec, "ModelOverride")
EngineOverride = _partial(EngineSpec, "EngineOverride")


class ArmSpec(Strict):
    """Overrides for one arm. `speculative` replaces the shared one whole (null turns it off); `code` pins the
    engine code the arm runs to a git revision (default: the working tree)."""

    model: Optional[ModelOverride] = None  # type: ignore[valid-type]
    engine: Optional[EngineOverride] = None  # type: ignore[valid-type]
    speculative: Optional[SpeculativeSpec] = None
    code: Optional[CodeSpec] = None
    description: str = ""


class Arms(Strict):
    baseline: ArmSpec = Field(default_factory=ArmSpec)
    candidate: ArmSpec = Field(default_factory=ArmSpec)


class ArmSettings(Strict):
    """One arm's effective settings: what its engine is opened with. `reasoning` (the contract's
    sampling.reasoning, fingerprinted with the contract) reaches the chat template of every chat request."""

    name: str
    model: ModelSpec
    engine: EngineSpec
    speculative: Optional[SpeculativeSpec] = None
    reasoning: ReasoningSpec = Field(default_factory=ReasoningSpec)
    code: Optional[CodeRevision] = None  # set by gates/revision when an arm of the run pins code

    def canonical_json(self) -> str:
        """The settings that identify the arm; the code's commit and dirty hash only when the run resolved
        them (so fingerprints of arms that run in-process are what they always were)."""
        data = self.model_dump(mode="json", exclude={"name", "reasoning", "code"})
        if self.code is not None:
            data["code"] = self.code.model_dump(mode="json", include=set(CodeRevision.FINGERPRINT_FIELDS))
        return canonical_json(data)

    def engine_args(self, seed: int, with_options: bool = True) -> EngineArgs:
        """The onecat engine's settings for this arm (ENGINE_ARGS_IN_CONTRACT), for a run with `seed`;
        `with_options`: engine.options holds EngineArgs settings (backend onecat), else the backend's own.
        Raises ValueError naming an engine.options key that is not an engine setting of its own."""
        options = self.engine.options if with_options else {}
        unknown = sorted(set(options) - set(ENGINE_OPTIONS))
        if unknown:
            raise ValueError("; ".join(_misplaced_option(k) for k in unknown))
        values: dict[str, Any] = {"seed": seed, "speculative_config": self.speculative, **options}
        for name, where in ENGINE_ARGS_IN_CONTRACT.items():
            section, _, key = where.partition(".")
            if section in ("model", "engine") and "." not in key:
                values[name] = getattr(getattr(self, section), key)
        return EngineArgs.model_validate(values, strict=True)

    @property
    def fingerprint(self) -> str:
        return sha256_text(self.canonical_json())


def _misplaced_option(key: str) -> str:
    where = ENGINE_ARGS_IN_CONTRACT.get(key)
    if where is not None:
        return f"{key!r} is not an option: it lives at {where}" + (" (each run's seed)" if where == "seeds" else "")
    return f"unknown engine option {key!r}; the onecat backend's options are {', '.join(ENGINE_OPTIONS)}"


# --------------------------------------------------------------------------- workloads and gates
class WorkloadBase(BaseModel):
    """Common fields of every workload. Runners subclass it with `kind: Literal[...]` and extra="forbid".

    `name` identifies the workload inside the contract (gates point at it); default: the kind.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)
    kind: str
    name: Optional[str] = Field(default=None, pattern=r"^[A-Za-z0-9_.-]+$")

    @property
    def id(self) -> str:
        return self.name or self.kind

    def datasets(self) -> list[str]:
        """Dataset names this workload reads (resolved before anything is loaded)."""
        ds = getattr(self, "dataset", None)
        return [ds] if isinstance(ds, str) else []


class GateBase(BaseModel):
    """Common fields of every gate. Checks subclass it as their `Config` with `check: Literal[...]`.

    informative: evaluated, stored and reported, but never changes the verdict.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)
    check: str
    name: Optional[str] = None
    informative: bool = False

    @property
    def id(self) -> str:
        return self.name or (f"{self.check}:{self.workload}" if getattr(self, "workload", None) else self.check)


class _OpenWorkload(WorkloadBase):
    model_config = ConfigDict(extra="allow", frozen=True)


class _OpenGate(GateBase):
    model_config = ConfigDict(extra="allow", frozen=True)


# --------------------------------------------------------------------------- the contract
class Contract(Strict):
    version: Literal[1] = 1
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    description: str = ""
    model: ModelSpec
    engine: EngineSpec = Field(default_factory=EngineSpec)
    speculative: Optional[SpeculativeSpec] = None
    sampling: SamplingSpec = Field(default_factory=SamplingSpec)
    seeds: list[int] = Field(default_factory=lambda: [0], min_length=1)
    arms: Arms = Field(default_factory=Arms)
    execution: ExecutionSpec = Field(default_factory=ExecutionSpec)
    datasets: dict[str, DatasetRef] = Field(default_factory=dict)
    limits: Optional[ContractLimits] = None  # explicit raises of the size bounds (gates/limits.py)
    workloads: list[SerializeAsAny[_OpenWorkload]] = Field(min_length=1)  # typed per kind by parse_contract
    gates: list[SerializeAsAny[_OpenGate]] = Field(min_length=1)  # typed per check by parse_contract

    @field_validator("seeds")
    @classmethod
    def _unique_seeds(cls, v: list[int]) -> list[int]:
        repeated = sorted(s for s, n in Counter(v).items() if n > 1)
        if repeated:
            raise ValueError(f"seeds must be distinct; repeated: {repeated[:10]}")
        return v

    def canonical_json(self) -> str:
        # no `limits:` block / arm `code:` -> no key: fingerprints of contracts written before they existed are
        # unchanged
        exclude: dict[str, Any] = {"limits": True} if self.limits is None else {}
        unpinned = {a: {"code": True} for a in ARM_NAMES if getattr(self.arms, a).code is None}
        if unpinned:
            exclude["arms"] = unpinned
        return canonical_json(self.model_dump(mode="json", exclude=exclude or None))

    @property
    def pins_code(self) -> bool:
        """Whether an arm runs the engine at a git revision (then both arms run in worker processes)."""
        return any(getattr(self.arms, a).code is not None for a in ARM_NAMES)

    @property
    def fingerprint(self) -> str:
        return sha256_text(self.canonical_json())

    def arm(self, name: str) -> ArmSettings:
        if name not in ARM_NAMES:
            raise ValueError(f"unknown arm {name!r}; arms are {ARM_NAMES}")
        over: ArmSpec = getattr(self.arms, name)
        model, engine = self.model, self.engine
        if over.model is not None:
            model = ModelSpec.model_validate({**model.model_dump(), **over.model.model_dump(exclude_none=True)})
        if over.engine is not None:
            engine = EngineSpec.model_validate({**engine.model_dump(), **over.engine.model_dump(exclude_none=True)})
        spec = over.speculative if "speculative" in over.model_fields_set else self.speculative
        return ArmSettings(name=name, model=model, engine=engine, speculative=spec, reasoning=self.sampling.reasoning)

    def workload(self, workload_id: str) -> WorkloadBase:
        for w in self.workloads:
            if w.id == workload_id:
                return w
        raise KeyError(f"no workload {workload_id!r} in contract {self.name}; have {[w.id for w in self.workloads]}")


# --------------------------------------------------------------------------- helpers
def canonical_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


# --------------------------------------------------------------------------- entry points
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
        from onecat.gates.contract_checks import cross_checks  # late: it reads the typed Contract
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
