"""Every engine setting, declared once: `EngineArgs` (names as vLLM's engine arguments).

`LLM(model, **settings)` takes exactly these names; `onecat serve` generates its engine flags from
them (cli/serve.py); the server's config holds one (engine/server/app.py); a gate contract's
`model`, `engine` and `speculative` sections derive their engine fields from them
(gates/contract/settings.py says where each one lives in a contract).

A setting declared here but not implemented by the engine (tensor parallelism, piecewise CUDA
graphs, ...) validates, because contracts also describe peers such as vLLM that run it, and is
refused by `EngineArgs.unsupported()`: the one place that `LLM` and the harness preflight ask, which asks the
support matrix (engine/support_matrix) about the settings alone.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Optional

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, model_validator

from onecat.engine.errors import ConfigError
from onecat.engine.support_matrix import SPECULATIVE_METHODS, Combination, check

DRAFTER_METHODS = ("draft_model", "dflash")
NGRAM_ONLY = ("prompt_lookup_min", "prompt_lookup_max", "adaptive", "max_speculative_tokens")
SYNTHETIC_ONLY = ("acceptance_length", "compute")
DTYPE_ALIASES = {"float": "float32", "fp32": "float32", "half": "float16", "fp16": "float16", "bf16": "bfloat16"}


def _dtype_name(value: Any) -> Any:
    """vLLM's aliases (half, float) and torch dtypes (a drafter inherits the target's) become the plain name."""
    if type(value).__name__ == "dtype" and type(value).__module__ == "torch":
        value = str(value).removeprefix("torch.")
    return DTYPE_ALIASES.get(value, value) if isinstance(value, str) else value


def _graph_mode(value: Any) -> Any:
    """`cuda_graph=True` / `False` (the engine's older switch) mean full / off."""
    return {True: "full", False: "off"}[value] if isinstance(value, bool) else value


def _known_method(value: Any) -> Any:
    if isinstance(value, str) and value not in SPECULATIVE_METHODS:
        raise ValueError(f"speculative method {value!r} is not supported; choose one of "
                         f"{', '.join(SPECULATIVE_METHODS)}")
    return value


def _positive(value: int) -> int:
    if value < 1:
        raise ValueError(f"{value} is not a positive integer; draft at least 1 token per step")
    return value


def _power_of_two(value: int) -> int:
    if value < 1 or value & (value - 1):
        raise ValueError(f"{value} is not a power of two (e.g. 16)")
    return value


Dtype = Annotated[Literal["auto", "float32", "float16", "bfloat16"], BeforeValidator(_dtype_name)]
CudaGraphMode = Annotated[Literal["off", "full", "piecewise"], BeforeValidator(_graph_mode)]
SpeculativeMethod = Annotated[Literal[SPECULATIVE_METHODS], BeforeValidator(_known_method)]


class SpeculativeConfig(BaseModel):
    """Speculative decoding: proposer method, its drafter (if any), and tokens proposed per step.
    A setting the chosen method never reads is refused: it would be silently unused."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    method: SpeculativeMethod = Field(description="ngram (prompt lookup), draft_model, dflash (block drafter), mtp "
                                                  "(the checkpoint's own multi-token-prediction head), synthetic "
                                                  "(acceptance set by construction, for measuring a round's cost)")
    model: Optional[str] = Field(default=None, description="drafter source: embedded:NAME, a path or a hub id")
    revision: Optional[str] = Field(default=None, description="drafter revision (hub ids)")
    dtype: Dtype = Field(default="auto", description="drafter dtype (draft_model, dflash); auto: the target's")
    num_speculative_tokens: Annotated[int, AfterValidator(_positive)] = Field(
        description="tokens drafted per step")
    prompt_lookup_min: Optional[int] = Field(default=None, ge=1, description="ngram: shortest n-gram matched")
    prompt_lookup_max: Optional[int] = Field(default=None, ge=1, description="ngram: longest n-gram matched")
    adaptive: Optional[bool] = Field(default=None, description="ngram: widen k after fully accepted drafts")
    max_speculative_tokens: Optional[int] = Field(default=None, ge=1, description="ngram: adaptive ceiling")
    acceptance_length: Optional[float] = Field(
        default=None, ge=1.0, description="synthetic: the acceptance length set by construction (drafts accepted "
                                          "per round + 1; fractional spreads over the rounds)")
    compute: Optional[Literal["ngram", "dflash", "mtp"]] = Field(
        default=None, description="synthetic: the drafter whose compute runs every round before its draft is "
                                  "replaced: ngram (prompt lookup, default), dflash (a random-weight DFlash drafter "
                                  "of the published shape for the target, block num_speculative_tokens + 1) or mtp "
                                  "(the target checkpoint's own multi-token-prediction head)")
    exact_batch1: bool = Field(
        default=False, description="CUDA with the fused kernels, batch 1: verify the 1 + k rows of a round through "
                                   "the batch-1 GEMV, row by row as a decode step computes them, so greedy output "
                                   "equals target-only's bit for bit; the weights are then read again for every row "
                                   "(a round of 8 rows costs ~4 plain steps on a Llama-3-8B shape on an H200, "
                                   "docs/speculative.md). false: the library GEMM reads them once, and a near-tie "
                                   "may break the other way than in target-only decoding, as at batch > 1")
    draft_vocab_size: Optional[int] = Field(
        default=None, ge=1, description="dflash, mtp (and synthetic with compute dflash or mtp): score drafts over "
                                        "the N most frequent target tokens (draft_vocab.json in the drafter's folder, "
                                        "for mtp in the target checkpoint's) instead of the whole LM head; the "
                                        "verifier still scores every token, so outputs keep the target's law")
    quantization: Optional[Literal["fp8", "nvfp4", "mxfp4", "w4a16"]] = Field(
        default=None, description="dflash (and synthetic with compute dflash), draft_model: the drafter's linear "
                                  "layers quantized at load, round to nearest (engine/speculative/drafter_quant.py; "
                                  "a draft model: its engine's quantization): fewer bytes a round; drafts may "
                                  "change, the output keeps the target's law (the verifier is exact)")
    disable_when_slower: bool = Field(
        default=True, description="decode steps without drafts while the engine measures a speculative round "
                                  "moving fewer tokens per second than a plain step (re-measured now and then); "
                                  "false: draft every step")

    def _drafter_settings(self) -> list[str]:
        """The drafter settings given (model, revision, a dtype other than auto)."""
        return [n for n in ("model", "revision") if getattr(self, n) is not None] + \
            (["dtype"] if self.dtype != "auto" else [])

    @model_validator(mode="after")
    def _no_ignored_settings(self) -> "SpeculativeConfig":
        synthetic_only = [n for n in SYNTHETIC_ONLY if getattr(self, n) is not None]
        if self.method != "synthetic" and synthetic_only:
            raise ValueError(f"{', '.join(synthetic_only)}: only method synthetic (acceptance set by construction) "
                             f"reads {'these' if len(synthetic_only) > 1 else 'this'}; remove "
                             f"{'them' if len(synthetic_only) > 1 else 'it'} for method {self.method!r}")
        ngram_only = [n for n in NGRAM_ONLY if getattr(self, n) is not None]
        if self.method != "ngram" and ngram_only:
            them = "them" if len(ngram_only) > 1 else "it"
            raise ValueError(f"{', '.join(ngram_only)}: only method ngram (prompt lookup) reads "
                             f"{'these' if len(ngram_only) > 1 else 'this'}; method {self.method!r} ignores "
                             f"{them}: remove {them}")
        dflash = self.method == "dflash" or (self.method == "synthetic" and self.compute == "dflash")
        mtp = self.method == "mtp" or (self.method == "synthetic" and self.compute == "mtp")
        if self.draft_vocab_size is not None and not (dflash or mtp):
            raise ValueError(f"draft_vocab_size: only a DFlash drafter or an MTP head (methods dflash and mtp, or "
                             f"synthetic with either compute) scores drafts over a draft vocabulary; method "
                             f"{self.method!r} ignores it: remove it")
        if self.quantization is not None and not (dflash or self.method == "draft_model"):
            raise ValueError(f"quantization: only a drafter model (methods dflash and draft_model, or synthetic with "
                             f"compute dflash) is quantized at load; method {self.method!r} ignores it: remove it")
        drafter = self._drafter_settings()
        if self.method == "ngram":
            if drafter:
                raise ValueError(f"method ngram drafts by looking up the prompt and has no drafter model: remove "
                                 f"{', '.join(drafter)} (or choose a drafter method: {', '.join(DRAFTER_METHODS)})")
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            if lo is not None and hi is not None and lo > hi:
                raise ValueError(f"prompt_lookup_min {lo} is above prompt_lookup_max {hi}: no n-gram can match")
            if self.max_speculative_tokens is not None and not self.adaptive:
                raise ValueError("max_speculative_tokens is the ceiling of adaptive drafting and is ignored unless "
                                 "adaptive: true")
            if self.max_speculative_tokens is not None and self.max_speculative_tokens < self.num_speculative_tokens:
                raise ValueError(f"max_speculative_tokens {self.max_speculative_tokens} is below "
                                 f"num_speculative_tokens {self.num_speculative_tokens}")
        elif self.method == "synthetic":
            if drafter:
                raise ValueError(f"method synthetic runs a random drafter of the target's shape (compute) and has no "
                                 f"drafter model: remove {', '.join(drafter)}")
            if self.acceptance_length is None:
                raise ValueError("method synthetic needs acceptance_length: the acceptance length its drafts are "
                                 "built to reach (e.g. 4.25)")
            if self.acceptance_length > self.num_speculative_tokens + 1:
                raise ValueError(f"acceptance_length {self.acceptance_length} is above num_speculative_tokens + 1 "
                                 f"= {self.num_speculative_tokens + 1}, the most a round can emit: raise "
                                 "num_speculative_tokens or lower acceptance_length")
        elif self.method == "mtp":
            if drafter:
                raise ValueError(f"method mtp drafts with the target checkpoint's own multi-token-prediction head, in "
                                 f"the target's dtype, and has no drafter model: remove {', '.join(drafter)}")
        elif self.model is None:
            raise ValueError(f"speculative method {self.method!r} needs a drafter `model` (embedded:NAME, a path "
                             "or a hub id)")
        if self.revision is not None and self.model is None:
            raise ValueError("revision pins the drafter model: set model too, or remove revision")
        return self


def _flags(*names: str) -> dict:
    """Extra command-line spellings of a setting (vLLM's short forms)."""
    return {"flags": list(names)}


class EngineArgs(BaseModel):
    """How the engine runs a model. Frozen; unknown names are refused."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(min_length=1, description="embedded:NAME, an HF directory, a .gguf file or a cached hub id")
    revision: Optional[str] = Field(default=None, description="model revision (hub ids)")
    dtype: Dtype = Field(default="auto", description="weights and activations; auto: float32 on CPU, else the "
                                                      "checkpoint's half type")
    quantization: Optional[str] = Field(default=None, json_schema_extra=_flags("-q"),
                                        description="gguf: keep a GGUF's Q4_0/Q4_1/Q8_0 tensors packed (CPU); "
                                                    "w4a16 | awq | gptq | compressed-tensors: keep a 4-bit "
                                                    "checkpoint packed for the W4A16 kernels (CUDA; w4a16 "
                                                    "quantizes a dense one at load); nvfp4 | mxfp4: keep an "
                                                    "NVFP4 (ModelOpt) / MXFP4 checkpoint packed for the FP4 "
                                                    "kernels (CUDA); unset: dequantized")
    load_format: Literal["auto", "dummy", "dummy_peaked"] = Field(
        default="auto", description="auto: the checkpoint's weights | dummy: random weights of the checkpoint's "
                                    "shapes (its config and tokenizer only), for speed measurements | "
                                    "dummy_peaked: the same, with each next token chosen by a wide margin (the "
                                    "projections writing the residual stream scaled down, the LM head the "
                                    "embedding), so no summation order flips a token: speculation's speed "
                                    "against target-only")
    cpu_prompt_matmul: Literal["int8", "bf16"] = Field(
        default="int8", description="the packed GGUF layers' prompt rows on the CPU (quantization gguf) | int8: int8 "
                                    "dot products like every other row, so a token's result never depends on its "
                                    "batch or on whether it was a prompt token | bf16: AMX bfloat16 tiles on a bf16 "
                                    "copy of the dequantized weights, and their attention on tiles too where the KV "
                                    "cache is bfloat16 (CPUs with AMX-BF16; 2 more bytes a weight; prefill ~2x "
                                    "faster), each row computed alone so its bits still do not depend on its batch, "
                                    "but decoded and verified rows stay as they were: a text's tokens computed as a "
                                    "prompt and as decoded output carry other bits (docs/server.md, AMX)")
    kv_cache_dtype: Literal["auto", "bfloat16", "fp8_e4m3", "fp8_e5m2"] = Field(
        default="auto", description="auto: the model dtype; bfloat16: half the bytes of a float32 model's "
                                    "(CPU); fp8_e4m3 | fp8_e5m2: 8-bit KV with scales")
    max_model_len: Optional[int] = Field(default=None, ge=1, description="context length; default: the model's")
    max_num_seqs: int = Field(default=64, ge=1, description="sequences decoded together")
    max_num_batched_tokens: int = Field(default=2048, ge=1, description="tokens per engine step (chunked prefill)")
    admission_wave: int = Field(
        default=1, ge=1, description="while sequences decode, waiting requests start only once this many of them "
                                     "(or all that wait, if fewer) have free slots, then together: fewer steps mix "
                                     "prefill into decoding, and a mixed step runs eagerly where pure decode steps "
                                     "replay CUDA graphs (offline batch jobs); 1: each starts as soon as a slot frees")
    block_size: Annotated[int, AfterValidator(_power_of_two)] = Field(default=16, description="tokens per KV block")
    enable_prefix_caching: bool = Field(default=True, description="reuse KV blocks of shared prompt prefixes")
    seed: int = Field(default=0, description="seed of requests that give none")
    device: str = Field(default="auto", pattern=r"^(auto|cpu|cuda(:[0-9]+)?)$",
                        description="auto | cpu | cuda | cuda:N")
    attention_backend: str = Field(default="auto",
                                   description="auto | TORCH_SDPA_REF | CPU_PAGED | FLASH_ATTN_V100 | TRITON_PAGED")
    cuda_graph: CudaGraphMode = Field(default="off", description="off | full: decode steps replay captured "
                                                                  "graphs on CUDA | piecewise (not implemented)")
    kv_cache_memory_gb: Optional[float] = Field(default=None, gt=0,
                                                description="KV cache budget in GiB; default: 90% of free GPU "
                                                            "memory, or $ONECAT_CPU_KVCACHE_SPACE (2) on CPU")
    num_kv_blocks: Optional[int] = Field(default=None, ge=1, description="fix the KV cache size in blocks")
    speculative_config: Optional[SpeculativeConfig] = Field(
        default=None, description='JSON, e.g. {"method": "ngram", "num_speculative_tokens": 4}')
    fused_kernels: bool = Field(default=True, description="fused kernels for the small per-layer ops: Triton on CUDA, C++ ops on CPU (float32)")
    async_scheduling: bool = Field(default=True, description="with CUDA graphs: launch the next greedy decode "
                                                             "before reading this one")
    cpu_threads: Optional[int] = Field(default=None, ge=1, description="CPU intra-op threads; unset: the cores "
                                       "this process may use, less those other processes keep busy at start")
    tensor_parallel_size: int = Field(default=1, ge=1, json_schema_extra=_flags("-tp"),
                                      description="ranks one model is split over (one process per rank: GPUs "
                                                  "of one host over NCCL, or CPU processes over gloo)")
    disable_custom_all_reduce: bool = Field(
        default=False, description="tensor parallel on GPUs: sum every tensor with NCCL, not small ones with the "
                                   "one-shot kernel over peer-mapped GPU buffers")
    pipeline_parallel_size: int = Field(default=1, ge=1, json_schema_extra=_flags("-pp"),
                                        description="pipeline stages (not implemented: 1)")
    mamba_cache_mode: Literal["none", "all", "align"] = Field(
        default="none", description="prefix caching of hybrid models' recurrent state: none (prefix caching off "
                                    "for them) | align (state saved where chunks end, at block boundaries) | all "
                                    "(not implemented)")

    @model_validator(mode="after")
    def _wave_fits(self) -> "EngineArgs":
        if self.admission_wave > self.max_num_seqs:
            raise ValueError(f"admission_wave {self.admission_wave} exceeds max_num_seqs {self.max_num_seqs}: a wave "
                             f"could never start while a sequence decodes; set it to at most max_num_seqs")
        return self

    @classmethod
    def create(cls, **settings: Any) -> "EngineArgs":
        """EngineArgs from keyword settings; a bad or unknown one is a ConfigError naming it and the fix."""
        try:
            return cls(**settings)
        except ValidationError as exc:
            raise ConfigError(describe_errors(exc, "engine setting", list(cls.model_fields))) from None

    def as_kwargs(self) -> dict:
        """The settings that differ from the defaults, as `LLM(**kwargs)` takes them."""
        return self.model_dump(exclude_defaults=True)

    def unsupported(self) -> list[str]:
        """Settings declared (vLLM has them) but not implemented by this engine, alone or together, each with what
        to use: the settings stage of the support matrix (engine/support_matrix)."""
        return [r.message for r in check(Combination.from_settings(self), "settings")]


def describe_errors(exc: ValidationError, what: str, known: list[str] | None = None, spell=str) -> str:
    """One line per problem: `what name=value: reason`. `known` lists the accepted names (for an unknown one);
    `spell` renders a setting's name (e.g. as a command-line flag)."""
    lines = []
    for err in exc.errors():
        loc = [str(p) for p in err["loc"]]
        name = spell(loc[0]) + "".join(f".{p}" for p in loc[1:]) if loc else ""
        if err["type"] == "extra_forbidden":
            names = known if known is not None and len(loc) == 1 else []
            lines.append(f"unknown {what} {name!r}" + (f"; known: {', '.join(names)}" if names else ""))
            continue
        msg = err["msg"].removeprefix("Value error, ")
        value = f"={err['input']!r}" if loc and not isinstance(err["input"], dict) else ""
        lines.append(f"{what} {name}{value}: {msg}" if name else f"{what}s: {msg}")
    return "; ".join(lines)
