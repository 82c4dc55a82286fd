"""The contract's model: two arms compared on workloads, judged by gates.

Shared settings (model, engine, speculative, sampling, seeds; settings.py) hold for both arms;
`arms.baseline` / `arms.candidate` override only what differs (the fast path under test).
Workloads and gates are open sets: `WorkloadBase` / `GateBase` are what every runner's `Workload`
and every check's `Config` extend (gates/registry.py), and load.py types each item by its schema.

    Contract.fingerprint                            # sha256 of canonical JSON (defaults filled in)
    Contract.canonical_json()
    Contract.arm("baseline" | "candidate") -> ArmSettings   # effective model/engine/speculative
    ArmSettings.fingerprint                         # sha256 of the arm's effective engine settings
"""
from __future__ import annotations

import hashlib
import json
from collections import Counter
from typing import Annotated, Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, SerializeAsAny, create_model, field_validator

from onecat.engine.args import EngineArgs
from onecat.gates.contract.limits import ContractLimits
from onecat.gates.contract.settings import (ENGINE_ARGS_IN_CONTRACT, ENGINE_OPTIONS, CodeRevision, CodeSpec, DatasetRef,
                                            EngineSpec, ExecutionSpec, ModelSpec, ReasoningSpec, SamplingSpec,
                                            SpeculativeSpec, Strict)

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
    limits: Optional[ContractLimits] = None  # explicit raises of the size bounds (limits.py)
    workloads: list[SerializeAsAny[_OpenWorkload]] = Field(min_length=1)  # typed per kind by load.parse_contract
    gates: list[SerializeAsAny[_OpenGate]] = Field(min_length=1)  # typed per check by load.parse_contract

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
