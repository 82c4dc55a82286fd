"""The shared settings of a contract: model, engine, speculative decoding, sampling, execution.

Both arms start from these; an arm overrides only what differs (model.py). The engine settings are
onecat.engine.args.EngineArgs' own fields (same names as vLLM, same types, defaults and
validation); ENGINE_ARGS_IN_CONTRACT says where each one lives in a contract. The sampling settings
are onecat.engine.sampling_params.SamplingParams' own (names, types, bounds, help), with the
harness's defaults and narrower bounds where it needs them (SAMPLING_IN_CONTRACT). A value the
engine would silently ignore (an empty stop string, top_p under greedy decoding, n-gram sizes on a
drafter method) is refused, with what to do instead, so that a contract never claims a setting its
runs did not use.
"""
from __future__ import annotations

from copy import copy
from typing import Any, ClassVar, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, create_model, field_validator, model_validator

from onecat.engine.args import EngineArgs, SpeculativeConfig
from onecat.engine.sampling_params import setting as sampling_setting


class Strict(BaseModel):
    """Frozen, unknown keys refused: a typo in a contract is an error, never a silently unused key."""

    model_config = ConfigDict(extra="forbid", frozen=True)


# Where each engine setting (onecat.engine.args.EngineArgs) lives in a contract. `seeds` gives each run
# its seed; `engine.options.NAME` holds settings with no contract key of their own (backend onecat).
ENGINE_ARGS_IN_CONTRACT: dict[str, str] = {
    "model": "model.source", "revision": "model.revision", "dtype": "model.dtype",
    "quantization": "model.quantization", "seed": "seeds", "speculative_config": "speculative",
    **{name: f"engine.{name}" for name in (
        "device", "tensor_parallel_size", "pipeline_parallel_size", "kv_cache_dtype", "attention_backend",
        "cuda_graph", "enable_prefix_caching", "mamba_cache_mode", "max_model_len", "max_num_seqs",
        "max_num_batched_tokens")},
    **{name: f"engine.options.{name}" for name in (
        "block_size", "kv_cache_memory_gb", "num_kv_blocks", "fused_kernels", "async_scheduling", "cpu_threads",
        "disable_custom_all_reduce", "load_format", "admission_wave", "cpu_prompt_matmul")},
}
ENGINE_OPTIONS = tuple(name for name, where in ENGINE_ARGS_IN_CONTRACT.items() if where.startswith("engine.options."))


def _engine_fields(section: str) -> dict[str, Any]:
    """The EngineArgs fields a contract section holds, under their contract names, with their types,
    defaults, validation and help."""
    fields = {}
    for name, where in ENGINE_ARGS_IN_CONTRACT.items():
        head, _, key = where.partition(".")
        if head == section and "." not in key:
            field = copy(EngineArgs.model_fields[name])
            fields[key] = (field.annotation, field)
    return fields


ModelSpec = create_model(
    "ModelSpec", __base__=Strict, __doc__="The weights: `embedded:NAME`, a local path (HF dir or .gguf), or a hub "
                                          "id + revision; `sha256` pins their content.",
    **_engine_fields("model"), sha256=(Optional[str], Field(default=None, pattern=r"^[0-9a-f]{64}$")))

EngineSpec = create_model(
    "EngineSpec", __base__=Strict,
    __doc__="Engine settings (EngineArgs names) and the backend that runs them. For backend onecat, "
            "`options` holds the EngineArgs settings with no key here (ENGINE_OPTIONS); other backends "
            "define their own options.",
    backend=(str, "onecat"),  # a name registered in gates/engines (onecat, onecat_serve, openai, vllm_serve, ...)
    **_engine_fields("engine"),
    base_url=(Optional[str], None),  # openai backend: the endpoint to drive
    options=(dict[str, Any], Field(default_factory=dict)))  # backend-specific settings

SpeculativeSpec = SpeculativeConfig  # the contract's `speculative` section is the engine's speculative_config


class ReasoningSpec(Strict):
    """Thinking switch for reasoning models. Chat requests pass it to the chat template as `enable_thinking`
    (Qwen3-style templates) and `effort` as `reasoning_effort`; templates without them ignore both."""

    enabled: bool = False
    effort: Optional[Literal["minimal", "low", "medium", "high", "xhigh"]] = None

    @model_validator(mode="after")
    def _effort_needs_thinking(self) -> "ReasoningSpec":
        if self.effort is not None and not self.enabled:
            raise ValueError(f"effort {self.effort!r} is set but thinking is off: set enabled: true to think at "
                             f"that effort, or remove effort")
        return self

    def template_kwargs(self) -> dict[str, Any]:
        """The chat-template variables of this setting (vLLM's `chat_template_kwargs`)."""
        return {"enable_thinking": self.enabled, **({"reasoning_effort": self.effort} if self.effort else {})}


def _sampling_field(name: str, **contract: Any) -> tuple[Any, Any]:
    """SamplingParams' setting `name` as a contract field (its type, default, bounds and help), with what the
    contract changes: `annotation`, `default` / `default_factory`, narrower bounds."""
    declared = sampling_setting(name)
    annotation = contract.pop("annotation", declared.type)
    if "default_factory" not in contract:
        contract.setdefault("default", declared.default)
    return annotation, Field(description=declared.help, **{**declared.bounds.constraints(), **contract})


_SamplingSettings = create_model(
    "_SamplingSettings", __base__=Strict,
    temperature=_sampling_field("temperature", default=0.0),  # greedy unless the contract samples
    top_p=_sampling_field("top_p"), top_k=_sampling_field("top_k"), min_p=_sampling_field("min_p"),
    # always a number: the natural-EOS cap, hitting it counts as "capped"
    max_tokens=_sampling_field("max_tokens", annotation=int, default=256, ge=1),
    stop=_sampling_field("stop", annotation=list[str], default_factory=list))
# The SamplingParams settings a contract's `sampling` block holds, under their own names.
SAMPLING_IN_CONTRACT = tuple(_SamplingSettings.model_fields)


class SamplingSpec(_SamplingSettings):
    """Shared decoding settings: the SamplingParams settings of SAMPLING_IN_CONTRACT, and the chat template's
    reasoning switch. Values that would have no effect are refused, not ignored."""

    reasoning: ReasoningSpec = Field(default_factory=ReasoningSpec)

    @field_validator("stop")
    @classmethod
    def _no_empty_stop(cls, v: list[str]) -> list[str]:
        if any(s == "" for s in v):
            raise ValueError(f"stop {v!r} holds an empty string, which can never end a generation: remove it")
        return v

    @model_validator(mode="after")
    def _no_filters_under_greedy(self) -> "SamplingSpec":
        """Greedy decoding (temperature 0) takes the most likely token: the sampling filters never apply."""
        if self.temperature == 0.0:
            unused = [f"{name} {getattr(self, name)}" for name, off in (("top_p", (1.0,)), ("top_k", (0, -1)),
                                                                          ("min_p", (0.0,)))
                      if getattr(self, name) not in off]
            if unused:
                raise ValueError(f"{', '.join(unused)} has no effect with temperature 0 (greedy decoding takes the "
                                 f"most likely token): remove it, or set temperature > 0 to sample")
        return self


class ExecutionSpec(Strict):
    """How the arms are scheduled. interleave: keep both arms open and alternate throughput repeats
    A/B/A/B/.../A; false runs arm after arm (for engines too large to hold twice)."""

    interleave: bool = True


class DatasetRef(Strict):
    """Explicit location of a dataset; sha256 is required for names the registry does not pin."""

    path: Optional[str] = None
    sha256: Optional[str] = Field(default=None, pattern=r"^[0-9a-f]{64}$")
    url: Optional[str] = None


class CodeSpec(Strict):
    """The engine code an arm runs: any git revision of this repository (a branch, tag, `origin/main`,
    `HEAD~1`, a commit). Without it the arm runs the working tree. The harness checks the revision out as a
    worktree and runs that arm's engine in a worker process importing it (gates/revision/)."""

    ref: str = Field(min_length=1, max_length=256, pattern=r"^[^-\s][^\s]*$")


class CodeRevision(Strict):
    """An arm's engine code as resolved for one run: the commit (and, for the working tree, a sha256 of its
    uncommitted engine changes). Only `commit` and `dirty_sha256` enter the arm fingerprint; `ref` (what the
    contract or CLI named; None: the working tree), `source` (the folder the worker imports the engine from)
    and `label` (one line for reports) describe it."""

    commit: str = Field(pattern=r"^[0-9a-f]{40}$")
    dirty_sha256: Optional[str] = Field(default=None, pattern=r"^[0-9a-f]{64}$")
    ref: Optional[str] = None
    source: str
    label: str

    FINGERPRINT_FIELDS: ClassVar[frozenset[str]] = frozenset({"commit", "dirty_sha256"})
