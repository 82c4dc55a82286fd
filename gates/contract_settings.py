"""The shared settings of a contract: model, engine, speculative decoding, sampling, execution.

Both arms start from these; an arm overrides only what differs (gates/contract.py). Names follow
vLLM where it has them. A value the engine would silently ignore (an empty stop string, top_p
under greedy decoding, n-gram sizes on a drafter method) is refused here, with what to do instead,
so that a contract never claims a setting its runs did not use.
"""
from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class Strict(BaseModel):
    """Frozen, unknown keys refused: a typo in a contract is an error, never a silently unused key."""

    model_config = ConfigDict(extra="forbid", frozen=True)


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

    @model_validator(mode="after")
    def _no_ignored_settings(self) -> "SpeculativeSpec":
        """Refuse settings the chosen proposer never reads: they would be silently unused."""
        ngram_only = [n for n in ("prompt_lookup_min", "prompt_lookup_max", "adaptive", "max_speculative_tokens")
                      if getattr(self, n) is not None]
        if self.method != "ngram" and ngram_only:
            them = "them" if len(ngram_only) > 1 else "it"
            raise ValueError(f"{', '.join(ngram_only)}: only method ngram (prompt lookup) reads "
                             f"{'these' if len(ngram_only) > 1 else 'this'}; method {self.method!r} ignores "
                             f"{them}: remove {them}")
        if self.method == "ngram":
            drafter = [n for n in ("model", "revision") if getattr(self, n) is not None]
            drafter += ["dtype"] if self.dtype != "auto" else []
            if drafter:
                raise ValueError(f"method ngram drafts by looking up the prompt and has no drafter model: remove "
                                 f"{', '.join(drafter)} (or choose a drafter method: draft_model, dflash, eagle, eagle3)")
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            if lo is not None and hi is not None and lo > hi:
                raise ValueError(f"prompt_lookup_min {lo} is above prompt_lookup_max {hi}: no n-gram can match")
            if self.max_speculative_tokens is not None and not self.adaptive:
                raise ValueError("max_speculative_tokens is the ceiling of adaptive drafting and is ignored unless "
                                 "adaptive: true")
            if self.max_speculative_tokens is not None and self.max_speculative_tokens < self.num_speculative_tokens:
                raise ValueError(f"max_speculative_tokens {self.max_speculative_tokens} is below "
                                 f"num_speculative_tokens {self.num_speculative_tokens}")
        if self.revision is not None and self.model is None:
            raise ValueError("revision pins the drafter model: set model too, or remove revision")
        return self


class ReasoningSpec(Strict):
    """Thinking switch for reasoning models; `effort` maps to the chat template's reasoning level."""

    enabled: bool = False
    effort: Optional[Literal["minimal", "low", "medium", "high", "xhigh"]] = None

    @model_validator(mode="after")
    def _effort_needs_thinking(self) -> "ReasoningSpec":
        if self.effort is not None and not self.enabled:
            raise ValueError(f"effort {self.effort!r} is set but thinking is off: set enabled: true to think at "
                             f"that effort, or remove effort")
        return self


class SamplingSpec(Strict):
    """Shared decoding settings. Values that would have no effect are refused, not ignored."""

    temperature: float = Field(default=0.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1)  # 0 / -1: off
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    max_tokens: int = Field(default=256, ge=1)  # the natural-EOS cap: hitting it counts as "capped"
    stop: list[str] = Field(default_factory=list)
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
