"""The gate contract: what is compared (two arms), on which workloads, judged by which gates.

A contract is YAML validated into frozen pydantic models. Shared settings (model, engine,
speculative, sampling, seeds) hold for both arms; `arms.baseline` / `arms.candidate` override
only what differs (the fast path under test). Unknown keys are refused everywhere, and every
problem is reported as `FILE:LINE: key.path: what is wrong (what is allowed)`.

Workloads and gates are open sets: `kind` / `check` picks the pydantic schema registered for
it (a runner's `Workload`, a check's `Config`; see gates/registry.py), so a new runner or check
brings its own schema and the contract validates it with the same error reporting.

Public API (stable):
    load_contract(path) -> Contract                 # raises ContractError
    parse_contract(data: dict, source="<dict>", lines=None) -> Contract
    Contract.fingerprint                            # sha256 of canonical JSON (defaults filled in)
    Contract.canonical_json()
    Contract.arm("baseline" | "candidate") -> ArmSettings   # effective model/engine/speculative
    ArmSettings.fingerprint                         # sha256 of the arm's effective engine settings
    contract_warnings(contract) -> list[str]        # legal but suspicious (e.g. identical arms)
"""
from __future__ import annotations

import hashlib
import json
import types
import typing
from pathlib import Path
from typing import Any, Literal, Optional, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, SerializeAsAny, ValidationError, create_model, field_validator

from onecat.gates import registry

ARM_NAMES = ("baseline", "candidate")


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# --------------------------------------------------------------------------- shared settings
class ModelSpec(Strict):
    """The weights: `embedded:NAME`, a local path (HF dir or .gguf), or a hub id + revision."""

    source: str = Field(min_length=1)
    revision: Optional[str] = None
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"
    quantization: Optional[str] = None  # e.g. "gguf" (keep GGUF blocks packed), "nvfp4"; None: dequantized
    sha256: Optional[str] = Field(default=None, pattern=r"^[0-9a-f]{64}$")


class EngineSpec(Strict):
    """Engine settings; names follow vLLM where it has them."""

    backend: str = "onecat"  # a name registered in gates/engines (onecat, vllm, openai)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    tensor_parallel_size: int = Field(default=1, ge=1)
    pipeline_parallel_size: int = Field(default=1, ge=1)
    kv_cache_dtype: Literal["auto", "fp8_e4m3", "fp8_e5m2"] = "auto"
    attention_backend: str = "auto"  # auto | torch | FLASH_ATTN_V100 | ...
    cuda_graph: Literal["off", "full", "piecewise"] = "off"
    enable_prefix_caching: bool = True
    mamba_cache_mode: Literal["none", "all", "align"] = "none"
    max_model_len: Optional[int] = Field(default=None, ge=1)
    max_num_seqs: int = Field(default=64, ge=1)
    max_num_batched_tokens: int = Field(default=2048, ge=1)
    base_url: Optional[str] = None  # openai backend: the endpoint to drive
    options: dict[str, Any] = Field(default_factory=dict)  # backend-specific pass-through

    @field_validator("cuda_graph", mode="before")
    @classmethod
    def _bool_graph(cls, v: Any) -> Any:
        return {True: "full", False: "off"}.get(v, v) if isinstance(v, bool) else v


SPECULATIVE_METHODS = ("ngram", "draft_model", "dflash", "eagle", "eagle3", "mtp")


class SpeculativeSpec(Strict):
    """Speculative decoding: proposer method, its drafter (if any), and tokens proposed per step."""

    method: Literal["ngram", "draft_model", "dflash", "eagle", "eagle3", "mtp"]
    model: Optional[str] = None  # drafter source (embedded:, path, or hub id)
    revision: Optional[str] = None
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"
    num_speculative_tokens: int = Field(ge=1)
    prompt_lookup_min: Optional[int] = Field(default=None, ge=1)
    prompt_lookup_max: Optional[int] = Field(default=None, ge=1)
    adaptive: Optional[bool] = None  # ngram: widen k after fully accepted drafts
    max_speculative_tokens: Optional[int] = Field(default=None, ge=1)  # ngram adaptive ceiling


class ReasoningSpec(Strict):
    """Thinking switch for reasoning models; `effort` maps to the chat template's reasoning level."""

    enabled: bool = False
    effort: Optional[Literal["minimal", "low", "medium", "high", "xhigh"]] = None


class SamplingSpec(Strict):
    temperature: float = Field(default=0.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1)  # 0 / -1: off
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    max_tokens: int = Field(default=256, ge=1)  # the natural-EOS cap: hitting it counts as "capped"
    stop: list[str] = Field(default_factory=list)
    reasoning: ReasoningSpec = Field(default_factory=ReasoningSpec)


class ExecutionSpec(Strict):
    """How the arms are scheduled. interleave: keep both arms open and alternate throughput repeats
    A/B/A/B/.../A; false runs arm after arm (for engines too large to hold twice)."""

    interleave: bool = True


class DatasetRef(Strict):
    """Explicit location of a dataset; sha256 is required for names the registry does not pin."""

    path: Optional[str] = None
    sha256: Optional[str] = Field(default=None, pattern=r"^[0-9a-f]{64}$")
    url: Optional[str] = None


# --------------------------------------------------------------------------- arms as overrides
def _partial(model: type[BaseModel], name: str) -> type[BaseModel]:
    """Same fields as `model`, all optional: an arm names only the settings it changes."""
    fields = {k: (Optional[f.annotation], None) for k, f in model.model_fields.items()}
    return create_model(name, __base__=Strict, **fields)


ModelOverride = _partial(ModelSpec, "ModelOverride")
EngineOverride = _partial(EngineSpec, "EngineOverride")


class ArmSpec(Strict):
    """Overrides for one arm. `speculative` replaces the shared one whole (null turns it off)."""

    model: Optional[ModelOverride] = None  # type: ignore[valid-type]
    engine: Optional[EngineOverride] = None  # type: ignore[valid-type]
    speculative: Optional[SpeculativeSpec] = None
    description: str = ""


class Arms(Strict):
    baseline: ArmSpec = Field(default_factory=ArmSpec)
    candidate: ArmSpec = Field(default_factory=ArmSpec)


class ArmSettings(Strict):
    """One arm's effective settings: what its engine is opened with."""

    name: str
    model: ModelSpec
    engine: EngineSpec
    speculative: Optional[SpeculativeSpec] = None

    def canonical_json(self) -> str:
        return canonical_json(self.model_dump(mode="json", exclude={"name"}))

    @property
    def fingerprint(self) -> str:
        return sha256_text(self.canonical_json())


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
    workloads: list[SerializeAsAny[_OpenWorkload]] = Field(min_length=1)  # typed per kind by parse_contract
    gates: list[SerializeAsAny[_OpenGate]] = Field(min_length=1)  # typed per check by parse_contract

    @field_validator("seeds")
    @classmethod
    def _unique_seeds(cls, v: list[int]) -> list[int]:
        if len(set(v)) != len(v):
            raise ValueError(f"seeds must be distinct, got {v}")
        if any(s < 0 for s in v):
            raise ValueError(f"seeds must be >= 0, got {v}")
        return v

    def canonical_json(self) -> str:
        return canonical_json(self.model_dump(mode="json"))

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
        return ArmSettings(name=name, model=model, engine=engine, speculative=spec)

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


class ContractIssue(BaseModel):
    path: str
    message: str
    line: Optional[int] = None


class ContractError(ValueError):
    """A contract that cannot be used, with every problem found (file, line, key path, fix)."""

    def __init__(self, source: str, issues: list[ContractIssue]):
        self.source, self.issues = source, issues
        super().__init__(self.render())

    def render(self) -> str:
        out = [f"{self.source}: invalid contract ({len(self.issues)} problem{'s' * (len(self.issues) != 1)})"]
        for i in self.issues:
            where = f"{self.source}:{i.line}" if i.line else self.source
            out.append(f"  {where}: {i.path or '<top>'}: {i.message}")
        return "\n".join(out)


class _UniqueKeyLoader(yaml.SafeLoader):
    pass


def _line_map(text: str, source: str) -> tuple[Any, dict[tuple, int]]:
    """Parse YAML and remember the line of every key / list item (1-based); refuse duplicate keys."""
    try:
        root = yaml.compose(text, Loader=_UniqueKeyLoader)
        data = yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        raise ContractError(source, [ContractIssue(path="", line=mark.line + 1 if mark else None,
                                                   message=f"not valid YAML: {getattr(exc, 'problem', exc)}")])
    lines: dict[tuple, int] = {}
    dups: list[ContractIssue] = []

    def walk(node: Any, path: tuple) -> None:
        lines.setdefault(path, node.start_mark.line + 1)
        if isinstance(node, yaml.MappingNode):
            seen: set = set()
            for k, v in node.value:
                key = k.value
                if key in seen:
                    dups.append(ContractIssue(path=_fmt(path + (key,)), line=k.start_mark.line + 1,
                                              message="duplicate key; each key may appear once"))
                seen.add(key)
                lines[path + (key,)] = k.start_mark.line + 1
                walk(v, path + (key,))
        elif isinstance(node, yaml.SequenceNode):
            for i, v in enumerate(node.value):
                walk(v, path + (i,))

    if root is not None:
        walk(root, ())
    if dups:
        raise ContractError(source, dups)
    return data, lines


def _fmt(path: tuple) -> str:
    out = ""
    for p in path:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out


def _data_path(data: Any, loc: tuple) -> tuple:
    """Keep the parts of a pydantic error location that walk the input (drop union-member tags)."""
    path, node = [], data
    for part in loc:
        if isinstance(node, dict) and part in node:
            path.append(part)
            node = node[part]
        elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            path.append(part)
            node = node[part]
        elif isinstance(node, (dict, list)) or node is None:
            if isinstance(part, str) and not part.startswith(("function-", "literal[", "union[")) \
                    and part not in ("str", "int", "bool", "float", "list", "dict", "none"):
                if isinstance(node, dict):
                    path.append(part)  # a missing or unknown key: still name it
            node = None
    return tuple(path)


def _allowed_keys(model: Any, path: tuple) -> list[str] | None:
    """Field names of the pydantic model found at `path` under `model` (for unknown-key messages)."""
    for part in path:
        model = _unwrap_model(model, expect_index=isinstance(part, int))
        if model is None:
            return None
        if isinstance(part, int):
            continue
        if isinstance(model, type) and issubclass(model, BaseModel):
            if part not in model.model_fields:
                return sorted(model.model_fields)
            model = model.model_fields[part].annotation
        elif isinstance(model, tuple):  # dict value type
            model = model[1]
    model = _unwrap_model(model, expect_index=False)
    return sorted(model.model_fields) if isinstance(model, type) and issubclass(model, BaseModel) else None


def _unwrap_model(tp: Any, expect_index: bool) -> Any:
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return _unwrap_model(args[0], expect_index) if args else None
    if origin is list and expect_index:
        return typing.get_args(tp)[0]
    if origin is dict:
        return ("dict", typing.get_args(tp)[1])
    return tp


def _issues_from(exc: ValidationError, data: Any, lines: dict[tuple, int], prefix: tuple,
                 schema: Any) -> list[ContractIssue]:
    out = []
    for err in exc.errors():
        loc = prefix + tuple(err["loc"])
        path = _data_path(data, loc)
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            allowed = _allowed_keys(schema, path[len(prefix):-1] if len(path) > len(prefix) else ())
            msg = f"unknown key {path[-1]!r}" + (f"; allowed keys: {', '.join(allowed)}" if allowed else "")
        elif err["type"] == "missing":
            msg = "required key is missing"
        elif err["type"] == "literal_error":
            msg = f"{msg}, got {err.get('input')!r}"
        line = None
        for n in range(len(path), -1, -1):
            if path[:n] in lines:
                line = lines[path[:n]]
                break
        out.append(ContractIssue(path=_fmt(path), message=msg, line=line))
    return out


def _dedupe(issues: list[ContractIssue]) -> list[ContractIssue]:
    seen, out = set(), []
    for i in issues:
        key = (i.path, i.message)
        if key not in seen:
            seen.add(key)
            out.append(i)
    return out


# --------------------------------------------------------------------------- entry points
def load_contract(path: str | Path) -> Contract:
    p = Path(path)
    if not p.is_file():
        raise ContractError(str(path), [ContractIssue(path="", message="file not found" if not p.exists()
                                                      else "not a file")])
    text = p.read_text(encoding="utf-8")
    data, lines = _line_map(text, str(path))
    return parse_contract(data, source=str(path), lines=lines)


def parse_contract(data: Any, source: str = "<contract>", lines: dict[tuple, int] | None = None) -> Contract:
    """Validate a contract dict: shared schema, then each workload/gate against its registered schema."""
    registry.load_plugins()
    lines = lines or {}
    if not isinstance(data, dict):
        raise ContractError(source, [ContractIssue(path="", line=1, message=f"a contract is a mapping of keys, "
                                                                            f"got {type(data).__name__}")])
    issues: list[ContractIssue] = []
    try:
        contract = Contract.model_validate(data)
    except ValidationError as exc:
        issues = _issues_from(exc, data, lines, (), Contract)
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
                out.append(schema.model_validate(item))
            except ValidationError as exc:
                issues += _issues_from(exc, data, lines, (section, i), schema)
    if contract is not None and not issues:
        contract = contract.model_copy(update={"workloads": typed_w, "gates": typed_g})
        issues += _arm_issues(contract, data, lines)
    if contract is not None and not issues:
        issues += _cross_checks(contract, lines)
    if issues:
        raise ContractError(source, _dedupe(issues))
    return contract


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
                spec.model_validate({**base.model_dump(), **part.model_dump(exclude_none=True)})
            except ValidationError as exc:
                issues += _issues_from(exc, data, lines, ("arms", a, section), spec)
    return issues


def _cross_checks(c: Contract, lines: dict[tuple, int]) -> list[ContractIssue]:
    from onecat.gates.datasets import known_dataset  # late: datasets registers itself via registry

    issues = []
    ids = [w.id for w in c.workloads]
    for i, w in enumerate(c.workloads):
        if ids.count(w.id) > 1:
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
    for scope, eng in [("engine", c.engine)] + [(f"arms.{a}.engine", c.arm(a).engine) for a in ARM_NAMES]:
        if eng.backend not in registry.ENGINES:
            key = tuple(scope.split(".")) + ("backend",)
            issues.append(ContractIssue(path=f"{scope}.backend", line=lines.get(key) or lines.get(("engine", "backend")),
                                        message=f"unknown engine backend {eng.backend!r}; registered: "
                                                f"{', '.join(sorted(registry.ENGINES))}"))
    for a in ARM_NAMES:
        spec = c.arm(a).speculative
        if spec is not None and spec.method in ("draft_model", "dflash", "eagle", "eagle3") and not spec.model:
            issues.append(ContractIssue(path=f"arms.{a}.speculative.model", line=lines.get(("arms", a, "speculative")),
                                        message=f"speculative method {spec.method!r} needs a drafter `model`"))
    return _dedupe(issues)


def contract_warnings(c: Contract) -> list[str]:
    out = []
    if c.arm("baseline").fingerprint == c.arm("candidate").fingerprint:
        out.append("arms.baseline and arms.candidate have identical effective settings (an A/A run)")
    if c.sampling.temperature > 0 and any(getattr(g, "check", "") == "token_hash_equal" for g in c.gates):
        out.append("token_hash_equal with temperature > 0 relies on per-request seeds being honoured")
    return out
