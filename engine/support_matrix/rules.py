"""The rules of the support matrix: what the engine refuses (`Rule`) and what it runs differently from what was
asked (`Fallback`). Every refusal message of a combination of settings is made here, from one rule:
`[support matrix: CELL] what is refused: why; what to do instead`, the cell naming the values that decide it.

The rules of a stage are listed in the order the engine reports them; `check` keeps that order.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Union

from onecat.engine.errors import ConfigError
from onecat.engine.support_matrix.axes import (CPU_INT4_FORMATS, CUDA_BACKENDS, GRAPH_SAFE_BACKENDS,
                                               HF_QUANTIZED_FORMATS, HYBRID_ARCHITECTURES, MOE_ARCHITECTURES,
                                               MTP_ARCHITECTURES, NO_CPU_KERNEL, QUANTIZATIONS, QUANTIZED_AT_LOAD,
                                               RANDOM_LOAD_FORMATS, STAGES, Combination, label)

Text = Union[str, Callable[[Combination], str]]  # a str.format template over Combination.values(), or a function


def _render(text: Text, c: Combination) -> str:
    return text(c) if callable(text) else text.format(**c.values())


def _cell(reads: tuple[str, ...], c: Combination) -> str:
    names = [label(name, getattr(c, name)) for name in reads]
    return " x ".join(n for n in names if n is not None)


@dataclass(frozen=True)
class Rule:
    """One refusal: `applies` over the fields in `reads` (all known at `stage`), what is refused, why, and what to
    do instead. `only_when` says in words a model fact the rule also reads (the docs cannot know it), and
    `worst_case` gives the fact's value that makes the rule apply, for the docs."""

    name: str
    stage: str
    reads: tuple[str, ...]
    applies: Callable[[Combination], bool]
    refused: Text
    why: Text
    instead: Text
    example: dict[str, Any] = field(default_factory=dict)  # architecture, device and changes: a cell it refuses
    only_when: str | None = None
    worst_case: dict[str, Any] = field(default_factory=dict)

    def decided(self, c: Combination) -> bool:
        return all(c.known(name) for name in self.reads)

    def refuses(self, c: Combination) -> bool:
        return self.decided(c) and bool(self.applies(c))

    def cell(self, c: Combination) -> str:
        """The matrix cell the combination falls in for this rule, e.g. `qwen3_5 x nvfp4`."""
        return _cell(self.reads, c)

    def message(self, c: Combination) -> str:
        return (f"[support matrix: {self.cell(c)}] {_render(self.refused, c)}: {_render(self.why, c)}; "
                f"{_render(self.instead, c)}")


@dataclass(frozen=True)
class Refusal:
    rule: Rule
    cell: str
    message: str

    def __str__(self) -> str:
        return self.message


@dataclass(frozen=True)
class Fallback:
    """A combination that runs, but not as asked: what happens instead, and why."""

    name: str
    reads: tuple[str, ...]
    applies: Callable[[Combination], bool]
    happens: Text
    why: Text
    example: dict[str, Any] = field(default_factory=dict)

    def holds(self, c: Combination) -> bool:
        return all(c.known(name) for name in self.reads) and bool(self.applies(c))

    def cell(self, c: Combination) -> str:
        return _cell(self.reads, c)

    def what_happens(self, c: Combination) -> str:
        return _render(self.happens, c)

    def message(self, c: Combination) -> str:
        return f"[support matrix: {self.cell(c)}] {self.what_happens(c)} ({_render(self.why, c)})"


def _cpu_threads_where(c: Combination) -> str:
    return "tensor parallel ranks (each takes its share of the cores)" if c.tensor_parallel_size > 1 \
        else f"device {c.device}"


def _no_cpu_kernel_why(c: Combination) -> str:
    if c.quantization == "fp8":
        return "FP8 weights stay packed for the CUDA packed GEMV (its FP8 path), which has no CPU kernel"
    return "FP4 weights stay packed for the CUDA 4-bit GEMV kernels, which have no CPU kernel"


PACKED = ", ".join(QUANTIZATIONS)

RULES: tuple[Rule, ...] = (
    # ---- settings: EngineArgs.unsupported(), before anything loads
    Rule("pipeline-parallel", "settings", ("pipeline_parallel_size",), lambda c: c.pipeline_parallel_size > 1,
         "pipeline_parallel_size={pipeline_parallel_size} is not implemented",
         "onecat does not split the layers into stages",
         "use tensor_parallel_size to split the model instead (docs/parallel.md)",
         example=dict(architecture="llama", device="cpu", pipeline_parallel_size=2)),
    Rule("packed-weights-tensor-parallel", "settings", ("quantization", "tensor_parallel_size"),
         lambda c: c.quantization == "gguf" and c.tensor_parallel_size > 1,
         "quantization {quantization!r} with tensor_parallel_size {tensor_parallel_size} is not implemented",
         "GGUF packed weights are not sharded (they are packed while the file streams, outside the shard loader, "
         "and a K-quant super-block spans 256 input columns)",
         "drop quantization (the GGUF file is dequantized and sharded) or use tensor_parallel_size 1",
         example=dict(architecture="llama", device="cpu", quantization="gguf", checkpoint="gguf",
                      tensor_parallel_size=2)),
    Rule("packed-weights-dummy", "settings", ("quantization", "load_format"),
         lambda c: c.quantization is not None and c.quantization not in QUANTIZED_AT_LOAD
         and c.load_format in RANDOM_LOAD_FORMATS,
         "quantization {quantization!r} with load_format {load_format}",
         "random weights are dense, and {quantization} packs what its own checkpoints store",
         f"use a format that quantizes at load ({', '.join(QUANTIZED_AT_LOAD)}) or drop one of them",
         example=dict(architecture="qwen3", device="cpu", quantization="awq", load_format="dummy")),
    Rule("mamba-cache-all", "settings", ("mamba_cache_mode",), lambda c: c.mamba_cache_mode == "all",
         "mamba_cache_mode='all' is not implemented",
         "the recurrent state is saved where chunks end, not at every block boundary inside a chunk",
         "use mamba_cache_mode align (state saved where chunks end, at block boundaries) or none (prefix caching off "
         "for hybrid models)",
         example=dict(architecture="qwen3_5", device="cpu", mamba_cache_mode="all")),
    Rule("cuda-graph-piecewise", "settings", ("cuda_graph",), lambda c: c.cuda_graph == "piecewise",
         "cuda_graph='piecewise' is not implemented", "onecat captures whole decode steps",
         "use cuda_graph full (or off)",
         example=dict(architecture="qwen3_moe", device="cpu", cuda_graph="piecewise")),
    Rule("unknown-quantization", "settings", ("quantization",),
         lambda c: c.quantization is not None and c.quantization not in QUANTIZATIONS,
         "quantization {quantization!r} is not implemented", f"onecat keeps {PACKED} weights packed",
         "use one of them, or leave quantization unset (the checkpoint runs dequantized)",
         example=dict(architecture="llama", device="cpu", quantization="int3")),
    Rule("mtp-tensor-parallel", "settings", ("speculative", "tensor_parallel_size"),
         lambda c: c.speculative == "mtp" and c.tensor_parallel_size > 1,
         "speculative method mtp with tensor_parallel_size {tensor_parallel_size} is not implemented",
         "the multi-token-prediction head runs whole on rank 0, over the target's embedding and LM head, which the "
         "ranks keep sharded", "use tensor_parallel_size 1, or speculative method ngram",
         example=dict(architecture="qwen3_5", device="cpu", speculative="mtp", tensor_parallel_size=2)),
    # ---- device: the worker, once the device is resolved
    Rule("cpu-threads-off-cpu", "device", ("cpu_threads", "device", "tensor_parallel_size"),
         lambda c: c.cpu_threads and (c.device != "cpu" or c.tensor_parallel_size > 1),
         lambda c: f"cpu_threads on {_cpu_threads_where(c)}",
         "it sets the threads of a CPU engine of one rank", "remove cpu_threads",
         example=dict(architecture="llama", device="cpu", cpu_threads=True, tensor_parallel_size=2)),
    Rule("kv-bfloat16-cpu-only", "device", ("kv_cache_dtype", "device"),
         lambda c: c.kv_cache_dtype == "bfloat16" and c.device != "cpu",
         "kv_cache_dtype='bfloat16' on {device}",
         "a bfloat16 cache for another model dtype is a CPU path (the CUDA attention kernels read the model "
         "dtype or fp8)", "use kv_cache_dtype auto (a bfloat16 model's cache is bfloat16) or fp8_e4m3",
         example=dict(architecture="llama", device="cuda", kv_cache_dtype="bfloat16")),
    Rule("prompt-matmul-needs-packed-gguf-cpu", "device", ("cpu_prompt_matmul", "quantization", "device"),
         lambda c: c.cpu_prompt_matmul != "int8" and (c.quantization != "gguf" or c.device != "cpu"),
         "cpu_prompt_matmul={cpu_prompt_matmul!r} with quantization {quantization!r} on {device}",
         "it picks the matmul of the prompt rows of a GGUF model's packed layers on the CPU",
         "use quantization gguf on cpu, or leave cpu_prompt_matmul int8",
         example=dict(architecture="llama", device="cpu", cpu_prompt_matmul="bf16", checkpoint="gguf")),
    # ---- weights: check_quantization, before the checkpoint is read
    Rule("gguf-needs-gguf-file", "weights", ("quantization", "checkpoint"),
         lambda c: c.quantization == "gguf" and c.checkpoint != "gguf",
         "quantization='gguf' on an {checkpoint} checkpoint",
         "it needs a .gguf checkpoint, whose Q4_0/Q4_1/Q8_0 blocks it keeps packed", "leave quantization unset",
         example=dict(architecture="llama", device="cpu", quantization="gguf")),
    Rule("gguf-cpu-only", "weights", ("quantization", "device"),
         lambda c: c.quantization == "gguf" and c.device != "cpu",
         "quantization='gguf' on {device}", "its packed 4-bit kernel runs on CPU only",
         "leave quantization unset to run the checkpoint dequantized there",
         example=dict(architecture="llama", device="cuda", quantization="gguf", checkpoint="gguf")),
    Rule("packed-format-without-cpu-kernel", "weights", ("quantization", "device"),
         lambda c: c.quantization in NO_CPU_KERNEL and c.device == "cpu" and not c.has_cpu_kernel,
         "quantization={quantization!r} on cpu", _no_cpu_kernel_why,
         "leave quantization unset (the checkpoint runs dequantized) or use a 4-bit W4A16 format (w4a16, awq, gptq, "
         "compressed-tensors), which runs packed on CPU",
         example=dict(architecture="qwen3", device="cpu", quantization="nvfp4")),
    Rule("no-cpu-int4-kernel", "weights", ("quantization", "device", "packed_cpu_kernel"),
         lambda c: c.quantization in CPU_INT4_FORMATS and c.device == "cpu" and c.packed_cpu_kernel is False,
         "quantization={quantization!r} on cpu",
         "this torch has no CPU int4 packed matmul (torch.ops.aten._weight_int4pack_mm_for_cpu)",
         "install a torch that has it, or leave quantization unset (the checkpoint runs dequantized)",
         example=dict(architecture="llama", device="cpu", quantization="w4a16", packed_cpu_kernel=False)),
    Rule("quantized-format-needs-hf-checkpoint", "weights", ("quantization", "checkpoint"),
         lambda c: c.quantization in HF_QUANTIZED_FORMATS and c.checkpoint != "hf",
         "quantization={quantization!r} on a {checkpoint} checkpoint", "it reads a {quantization} HF checkpoint",
         "use quantization='w4a16' (quantized at load), 'gguf' on CPU, or leave it unset",
         example=dict(architecture="qwen3_5", device="cpu", quantization="awq", checkpoint="gguf")),
    # ---- model: once the checkpoint's config names the architecture
    Rule("mamba-cache-without-recurrent-state", "model", ("architecture", "mamba_cache_mode"),
         lambda c: c.mamba_cache_mode != "none" and not c.hybrid,
         "mamba_cache_mode={mamba_cache_mode!r} on {architecture}",
         "it saves the recurrent state of hybrid models; {architecture} has none", "use mamba_cache_mode none",
         example=dict(architecture="qwen3", device="cpu", mamba_cache_mode="align")),
    Rule("tensor-parallel-over-deltanet-heads", "model", ("architecture", "tensor_parallel_size", "linear_value_heads"),
         lambda c: c.hybrid and c.tensor_parallel_size > 1 and bool(c.linear_value_heads)
         and c.tensor_parallel_size > c.linear_value_heads,
         "tensor_parallel_size={tensor_parallel_size} exceeds the {linear_value_heads} Gated DeltaNet value heads of "
         "{architecture} (linear_num_value_heads)", "every rank needs at least one",
         "use tensor_parallel_size <= {linear_value_heads}",
         only_when="tensor_parallel_size exceeds the model's linear_num_value_heads",
         worst_case={"linear_value_heads": 1},
         example=dict(architecture="qwen3_5", device="cpu", tensor_parallel_size=8, linear_value_heads=4)),
    Rule("packed-weights-moe-hybrid", "model", ("architecture", "quantization"),
         lambda c: c.quantization == "gguf" and c.architecture in MOE_ARCHITECTURES + HYBRID_ARCHITECTURES,
         "quantization {quantization!r} is not implemented for {kind} models ({architecture})",
         "the GGUF packer keeps the 2-D blocks of the dense architectures' linears; MoE experts (stacked 3-D "
         "blocks) and the hybrid layers have no GGUF packed path",
         "leave quantization unset (the file runs dequantized), or use quantization='w4a16' (quantized at load, "
         "kept packed)",
         example=dict(architecture="qwen3_5", device="cpu", quantization="gguf", checkpoint="gguf")),
    Rule("mtp-without-mtp-head", "model", ("architecture", "speculative"),
         lambda c: c.speculative == "mtp" and c.architecture not in MTP_ARCHITECTURES,
         "speculative method mtp on {architecture}",
         f"method mtp drafts with the checkpoint's own multi-token-prediction head (mtp.* tensors), which "
         f"{', '.join(MTP_ARCHITECTURES)} checkpoints carry and {{architecture}} checkpoints do not",
         "use ngram, draft_model or dflash",
         example=dict(architecture="qwen3", device="cpu", speculative="mtp")),
    Rule("align-needs-prefix-caching", "model", ("architecture", "mamba_cache_mode", "enable_prefix_caching"),
         lambda c: c.hybrid and c.mamba_cache_mode == "align" and not c.enable_prefix_caching,
         "mamba_cache_mode='align' with prefix caching off",
         "align saves recurrent states for prefix caching, which is off",
         "set enable_prefix_caching true, or use mamba_cache_mode none",
         example=dict(architecture="qwen3_5_moe", device="cpu", mamba_cache_mode="align", enable_prefix_caching=False)),
)

FALLBACKS: tuple[Fallback, ...] = (
    Fallback("hybrid-prefix-caching-off", ("architecture", "enable_prefix_caching", "mamba_cache_mode"),
             lambda c: c.hybrid and c.enable_prefix_caching and c.mamba_cache_mode == "none",
             "prefix caching is off for the hybrid model {architecture}",
             "mamba_cache_mode none: the recurrent state is not kept per block; mamba_cache_mode align keeps it",
         example=dict(architecture="qwen3_5", device="cpu")),
    Fallback("cuda-graphs-on-cpu", ("cuda_graph", "device"), lambda c: c.cuda_graph == "full" and c.device == "cpu",
             "steps run eagerly", "CUDA graphs are captured on CUDA only",
         example=dict(architecture="llama", device="cpu", cuda_graph="full")),
    Fallback("cuda-graphs-attention-not-graph-safe", ("cuda_graph", "device", "attention_backend"),
             lambda c: c.cuda_graph == "full" and c.device == "cuda"
             and c.attention_backend not in GRAPH_SAFE_BACKENDS + ("auto",),
             "decode steps run eagerly", "attention backend {attention_backend} is not graph-safe",
         example=dict(architecture="llama", device="cuda", cuda_graph="full", attention_backend="FLASH_ATTN_V100")),
    Fallback("cuda-graphs-auto-below-sm80", ("cuda_graph", "device", "attention_backend"),
             lambda c: c.cuda_graph == "full" and c.device == "cuda" and c.attention_backend == "auto",
             "below SM80 decode steps run eagerly",
             "auto selects TRITON_PAGED (graph-safe) on SM80 and newer, FLASH_ATTN_V100 on SM70 and TORCH_SDPA_REF "
             "elsewhere, neither graph-safe",
         example=dict(architecture="qwen3_moe", device="cuda", cuda_graph="full")),
    Fallback("packed-experts-eager", ("architecture", "quantization", "cuda_graph", "device"),
             lambda c: c.architecture in MOE_ARCHITECTURES and c.quantization == "fp8"
             and c.cuda_graph == "full" and c.device == "cuda",
             "decode steps run eagerly",
             "packed FP8 MoE experts run one routed expert at a time, picked on the host, which a CUDA graph cannot "
             "capture (NVFP4, MXFP4 and W4A16 experts take a routed GEMV, picked on the device; W4A16 experts with "
             "an act-order permutation pick on the host too)",
         example=dict(architecture="qwen3_5_moe", device="cuda", cuda_graph="full", quantization="fp8")),
    Fallback("attention-backend-off-its-device", ("attention_backend", "device"),
             lambda c: (c.attention_backend in CUDA_BACKENDS and c.device == "cpu")
             or (c.attention_backend == "CPU_PAGED" and c.device == "cuda"),
             "attention runs in TORCH_SDPA_REF",
             lambda c: f"{c.attention_backend} is a {'CUDA' if c.device == 'cpu' else 'CPU'} kernel",
         example=dict(architecture="qwen3", device="cpu", attention_backend="TRITON_PAGED")),
    Fallback("flash-attn-v100-bfloat16", ("attention_backend", "dtype", "device"),
             lambda c: c.attention_backend == "FLASH_ATTN_V100" and c.dtype == "bfloat16" and c.device == "cuda",
             "attention runs in TORCH_SDPA_REF",
             "V100 (SM70) has no bfloat16 arithmetic; FLASH_ATTN_V100 takes float16",
         example=dict(architecture="llama", device="cuda", attention_backend="FLASH_ATTN_V100", dtype="bfloat16")),
)

FALLBACKS_BY_NAME = {f.name: f for f in FALLBACKS}


def check(c: Combination, stage: str | None = None) -> list[Refusal]:
    """The refusals of the combination: of one stage (what the engine asks at that point), or of all stages."""
    if stage is not None and stage not in STAGES:
        raise ValueError(f"stage {stage!r}: one of {', '.join(STAGES)}")
    return [Refusal(r, r.cell(c), r.message(c)) for r in RULES
            if (stage is None or r.stage == stage) and r.refuses(c)]


def first_refusals(c: Combination) -> list[Refusal]:
    """The refusals the engine reports for the combination: those of the earliest stage that has any."""
    for stage in STAGES:
        found = check(c, stage)
        if found:
            return found
    return []


def refuse(c: Combination, *stages: str) -> None:
    """Raises ConfigError with the messages of the refusals of these stages, if any."""
    found = [r for stage in stages for r in check(c, stage)]
    if found:
        raise ConfigError("; ".join(r.message for r in found))


def fallbacks(c: Combination) -> list[Fallback]:
    return [f for f in FALLBACKS if f.holds(c)]
