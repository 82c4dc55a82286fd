"""The axes of the support matrix (the values each setting takes) and `Combination`, one point in it.

Pure data: this module imports nothing heavy, so `EngineArgs`, the harness preflight and the docs read it without
torch.

A combination is asked about in stages, as the engine learns it (each field belongs to the stage where it is
first known; a field not known yet is UNKNOWN, and a rule that reads it is not decided):

- settings: the engine settings alone (`EngineArgs.unsupported()`, before anything loads);
- device: the device the engine runs on (resolved from `auto`);
- weights: the checkpoint's file kind and whether this torch has the packed CPU kernel;
- model: the architecture and its facts (from the checkpoint's config).
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen3_moe", "qwen3_5", "qwen3_5_moe")
MOE_ARCHITECTURES = ("qwen3_moe", "qwen3_5_moe")
HYBRID_ARCHITECTURES = ("qwen3_5", "qwen3_5_moe")  # Gated DeltaNet linear attention + gated full attention
MTP_ARCHITECTURES = ("qwen3_5", "qwen3_5_moe")  # their checkpoints carry a multi-token-prediction head (mtp.*)
DENSE_DTYPES = ("float32", "bfloat16", "float16")
# `quantization`: the packed weight formats (unset: the checkpoint runs dequantized in the model dtype)
QUANTIZATIONS = ("gguf", "w4a16", "awq", "gptq", "compressed-tensors", "nvfp4", "mxfp4", "fp8")
HF_QUANTIZED_FORMATS = ("awq", "gptq", "compressed-tensors", "nvfp4", "mxfp4", "fp8")  # read from an HF checkpoint
NO_CPU_KERNEL = ("nvfp4", "mxfp4", "fp8")  # packed formats with a CUDA kernel only
QUANTIZED_AT_LOAD = ("w4a16", "nvfp4", "mxfp4", "fp8")  # a dense checkpoint or random weights is rounded at load
CPU_INT4_FORMATS = ("gguf", "w4a16", "awq", "gptq", "compressed-tensors")  # run in the CPU int4 packed layer
CHECKPOINTS = ("hf", "gguf")
# `load_format`s of random weights (engine/loader/dummy.py): as drawn, or peaked (each next token by a wide margin)
RANDOM_LOAD_FORMATS = ("dummy", "dummy_peaked")
SPECULATIVE_METHODS = ("ngram", "draft_model", "dflash", "mtp", "synthetic")
KV_CACHE_DTYPES = ("auto", "bfloat16", "fp8_e4m3", "fp8_e5m2")
ATTENTION_BACKENDS = ("auto", "TORCH_SDPA_REF", "CPU_PAGED", "FLASH_ATTN_V100", "TRITON_PAGED")
GRAPH_SAFE_BACKENDS = ("TRITON_PAGED",)  # decode steps under this backend can be captured in a CUDA graph
CUDA_BACKENDS = ("FLASH_ATTN_V100", "TRITON_PAGED")
CUDA_GRAPH_MODES = ("off", "full", "piecewise")
MAMBA_CACHE_MODES = ("none", "align", "all")
DEVICES = ("cpu", "cuda")
STAGES = ("settings", "device", "weights", "model")


class _Unknown:
    """A field the engine does not know yet at the stage it asks."""

    def __repr__(self) -> str:
        return "UNKNOWN"


UNKNOWN: Any = _Unknown()


@dataclass(frozen=True)
class Combination:
    """One point of the matrix. Settings carry EngineArgs' names and values (speculative: the method, or None)."""

    # settings
    quantization: str | None = UNKNOWN
    dtype: str = UNKNOWN
    load_format: str = UNKNOWN
    speculative: str | None = UNKNOWN
    speculative_dtype: str = UNKNOWN
    kv_cache_dtype: str = UNKNOWN
    attention_backend: str = UNKNOWN
    cuda_graph: str = UNKNOWN
    enable_prefix_caching: bool = UNKNOWN
    mamba_cache_mode: str = UNKNOWN
    tensor_parallel_size: int = UNKNOWN
    pipeline_parallel_size: int = UNKNOWN
    cpu_threads: bool = UNKNOWN  # set at all
    cpu_prompt_matmul: str = UNKNOWN
    # device
    device: str = UNKNOWN  # cpu | cuda
    # weights
    checkpoint: str = UNKNOWN  # hf | gguf
    packed_cpu_kernel: bool | None = UNKNOWN  # the packed format has a kernel on this CPU; None: as declared
    # model
    architecture: str = UNKNOWN
    linear_value_heads: int | None = UNKNOWN  # Gated DeltaNet value heads (None: the config has none)

    @classmethod
    def from_settings(cls, args: Any, **known: Any) -> "Combination":
        """The combination of an EngineArgs (read by attribute), plus the fields `known` beyond the settings."""
        spec = args.speculative_config
        return cls(quantization=args.quantization, dtype=args.dtype, load_format=args.load_format,
                   speculative=None if spec is None else spec.method,
                   speculative_dtype="auto" if spec is None else spec.dtype, kv_cache_dtype=args.kv_cache_dtype,
                   attention_backend=args.attention_backend, cuda_graph=args.cuda_graph,
                   enable_prefix_caching=args.enable_prefix_caching, mamba_cache_mode=args.mamba_cache_mode,
                   tensor_parallel_size=args.tensor_parallel_size, pipeline_parallel_size=args.pipeline_parallel_size,
                   cpu_threads=args.cpu_threads is not None, cpu_prompt_matmul=args.cpu_prompt_matmul, **known)

    def known(self, name: str) -> bool:
        return getattr(self, name) is not UNKNOWN

    def with_(self, **changes: Any) -> "Combination":
        return replace(self, **changes)

    @property
    def hybrid(self) -> bool:
        return self.architecture in HYBRID_ARCHITECTURES

    @property
    def kind(self) -> str:
        """The architecture's family, as messages name it."""
        if self.hybrid:
            return "hybrid (linear + full attention)"
        return "MoE" if self.architecture in MOE_ARCHITECTURES else "dense"

    @property
    def has_cpu_kernel(self) -> bool:
        """Whether the packed format runs on this CPU: as the engine found it, else as declared here."""
        if self.packed_cpu_kernel is not UNKNOWN and self.packed_cpu_kernel is not None:
            return self.packed_cpu_kernel
        return self.quantization not in NO_CPU_KERNEL

    def values(self) -> dict[str, Any]:
        """Every field plus the derived names, for message templates."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        return {**out, "kind": self.kind}


DEFAULTS = dict(quantization=None, dtype="auto", load_format="auto", speculative=None, speculative_dtype="auto",
                kv_cache_dtype="auto", attention_backend="auto", cuda_graph="off", enable_prefix_caching=True,
                mamba_cache_mode="none", tensor_parallel_size=1, pipeline_parallel_size=1, cpu_threads=False,
                cpu_prompt_matmul="int8",
                checkpoint="hf", packed_cpu_kernel=None)  # EngineArgs' defaults, an HF checkpoint


def example(architecture: str, device: str, **changes: Any) -> Combination:
    """A whole combination: the defaults with `changes`; the model facts of a dense architecture are none, a
    hybrid one's stay UNKNOWN unless given."""
    facts = {} if architecture in HYBRID_ARCHITECTURES else {"linear_value_heads": None}
    return Combination(**{**DEFAULTS, **facts, "architecture": architecture, "device": device, **changes})


STAGE_OF = {f.name: ("model" if f.name in ("architecture", "linear_value_heads") else
                     "weights" if f.name in ("checkpoint", "packed_cpu_kernel") else
                     "device" if f.name == "device" else "settings") for f in fields(Combination)}


def label(name: str, value: Any) -> str | None:
    """How a field's value names a matrix cell (None: it names none)."""
    if name in ("linear_value_heads", "packed_cpu_kernel"):
        return None
    if name in ("architecture", "device", "attention_backend"):
        return str(value)
    return {"quantization": lambda v: "dense" if v is None else v,
            "speculative": lambda v: "no speculation" if v is None else v,
            "speculative_dtype": lambda v: f"drafter {v}",
            "checkpoint": lambda v: f"{v} checkpoint",
            "enable_prefix_caching": lambda v: "prefix caching " + ("on" if v else "off"),
            "tensor_parallel_size": lambda v: f"tp={v}",
            "pipeline_parallel_size": lambda v: f"pp={v}",
            "cpu_threads": lambda v: "cpu_threads" if v else "cpu_threads unset",
            "cpu_prompt_matmul": lambda v: f"prompt rows {v}",
            "kv_cache_dtype": lambda v: f"kv {v}"}.get(name, lambda v: f"{name} {v}")(value)
