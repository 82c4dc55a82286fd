"""FLASH_ATTN_V100: Volta-native paged attention (HMMA.884 prefill, split-KV decode/verify).

Chosen automatically on compute capability 7.0; runs on any SM70+ GPU (m8n8k4 is valid PTX
there, emulated and slow on newer parts). Every call is capability-checked by
`unsupported_reason`, so the caller can fall back to the reference path for that call alone.

Kernel variants stay buildable side by side so that each step can be judged against the one
before (docs/kernels.md): `decode_variant` "regs" (default: K/V kept in registers) or "smem" (the
first kernel: K/V staged in shared memory), $ONECAT_FA_V100_DECODE sets the default;
`prefill_variant` "v0" (the first kernel) to "v3" (default; csrc/flash_attn_v100/prefill.cuh
lists what each adds), $ONECAT_FA_V100_PREFILL sets the default.
"""
from __future__ import annotations

import os

import torch

from onecat.engine.attention.backend import AttentionBackend
from onecat.engine.attention.metadata import AttentionMetadata
from onecat.engine.cache.kv import LayerKVCache

SUPPORTED_HEAD_DIMS = (64, 128, 256)
_FP8_KINDS = {torch.float8_e4m3fn: 1, torch.float8_e5m2: 2}
DECODE_VARIANTS = {"smem": 0, "regs": 1}
PREFILL_VARIANTS = {"v0": 0, "v1": 1, "v2": 2, "v3": 3}
DECODE_VARIANT_ENV = "ONECAT_FA_V100_DECODE"
PREFILL_VARIANT_ENV = "ONECAT_FA_V100_PREFILL"


def _variant(given: str | None, env: str, table: dict[str, int], default: str) -> str:
    """`given`, else $env, else `default`; an unknown name is an error, never silently ignored."""
    name = given or os.environ.get(env, default)
    if name not in table:
        raise ValueError(f"FLASH_ATTN_V100 variant {name!r} ({env}): choose one of {', '.join(table)}")
    return name


def kv_kind_of(cache: LayerKVCache) -> int:
    """0: float16 cache, 1: float8_e4m3fn bytes, 2: float8_e5m2 bytes."""
    return 0 if cache.fp8_dtype is None else _FP8_KINDS[cache.fp8_dtype]


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


class FlashAttnV100Backend(AttentionBackend):
    name = "FLASH_ATTN_V100"

    def __init__(self, decode_variant: str | None = None, prefill_variant: str | None = None):
        self.decode_variant = _variant(decode_variant, DECODE_VARIANT_ENV, DECODE_VARIANTS, "regs")
        self.prefill_variant = _variant(prefill_variant, PREFILL_VARIANT_ENV, PREFILL_VARIANTS, "v3")

    def unsupported_reason(self, q: torch.Tensor, cache: LayerKVCache,
                           meta: AttentionMetadata) -> str | None:
        if not torch.cuda.is_available():
            return "no CUDA device available"
        if q.device.type != "cuda":
            return f"query tensor is on {q.device}, not a CUDA device"
        major, minor = torch.cuda.get_device_capability(q.device)
        if (major, minor) < (7, 0):
            return f"compute capability {major}.{minor} < 7.0: mma.sync.m8n8k4 needs SM70 or newer"
        if q.dtype == torch.bfloat16:
            return ("bfloat16 unsupported: V100 (SM70) has no bf16 arithmetic or bf16 tensor cores; "
                    "load the model with dtype=float16")
        if q.dtype != torch.float16:
            return f"dtype {q.dtype} unsupported: these kernels take float16 queries"
        if q.dim() != 3 or q.stride(-1) != 1 or q.stride(1) != q.shape[-1]:
            return "query must be a [tokens, heads, head_dim] tensor with packed heads (any token stride)"
        head_dim = q.shape[-1]
        if head_dim not in SUPPORTED_HEAD_DIMS:
            return f"head_dim {head_dim} unsupported: kernels exist for {SUPPORTED_HEAD_DIMS}"
        k, v = cache.k, cache.v
        if k.dim() != 4 or k.shape != v.shape or k.shape[-1] != head_dim:
            return "KV cache must be [num_blocks, block_size, num_kv_heads, head_dim] matching the query"
        if not (k.is_contiguous() and v.is_contiguous()):
            return "KV cache tensors must be contiguous"
        if q.shape[1] % k.shape[2] != 0:
            return f"num_heads {q.shape[1]} is not a multiple of num_kv_heads {k.shape[2]}"
        if cache.fp8_dtype is None:
            if k.dtype != torch.float16 or v.dtype != torch.float16:
                return f"KV cache dtype {k.dtype} unsupported: float16, or 8-bit with fp8_dtype set"
        else:
            if cache.fp8_dtype not in _FP8_KINDS:
                return f"fp8 dtype {cache.fp8_dtype} unsupported: float8_e4m3fn or float8_e5m2"
            if k.element_size() != 1 or v.element_size() != 1:
                return "8-bit KV cache must be stored as 1-byte elements"
            if cache.k_scale is None or cache.v_scale is None:
                return "8-bit KV cache without k_scale/v_scale"
            if (cache.k_scale.dtype != torch.float32 or cache.v_scale.dtype != torch.float32
                    or not cache.k_scale.is_contiguous() or not cache.v_scale.is_contiguous()
                    or cache.k_scale.shape != k.shape[:3] or cache.v_scale.shape != v.shape[:3]):
                return "fp8 scales must be contiguous float32 [num_blocks, block_size, num_kv_heads]"
        for name in ("query_start_loc", "seq_lens", "block_tables"):
            t = getattr(meta, name)
            if t.dtype != torch.int32 or t.device != q.device or not t.is_contiguous():
                return f"metadata.{name} must be a contiguous int32 tensor on {q.device}"
        from onecat.engine.kernels.flash_attn_v100_ext import unavailable_reason

        reason = unavailable_reason()
        if reason is not None:
            return f"flash_attn_v100 extension unavailable: {reason}"
        return None

    def path_for(self, q: torch.Tensor, cache: LayerKVCache, meta: AttentionMetadata) -> str:
        """'decode' (split-KV, packed GQA rows; covers verify steps) or 'prefill' (HMMA tiles)."""
        from onecat.engine.kernels.flash_attn_v100_ext import load_extension

        group = q.shape[1] // cache.k.shape[2]
        max_rows = load_extension().decode_max_rows(q.shape[-1])
        return "decode" if meta.max_query_len * group <= max_rows else "prefill"

    def forward(self, q: torch.Tensor, cache: LayerKVCache, meta: AttentionMetadata,
                scale: float) -> torch.Tensor:
        from onecat.engine.kernels.flash_attn_v100_ext import load_extension

        ext = load_extension()
        q = q.contiguous()  # the fused QK-RoPE path hands a strided view of the qkv projection
        out = torch.empty_like(q)
        kind = kv_kind_of(cache)
        k, v = (cache.k, cache.v) if kind == 0 else (_as_bytes(cache.k), _as_bytes(cache.v))
        args = (out, q, k, v, cache.k_scale, cache.v_scale, kind,
                meta.query_start_loc, meta.seq_lens, meta.block_tables, meta.max_query_len)
        if self.path_for(q, cache, meta) == "decode":
            ext.decode(*args, meta.max_seq_len, float(scale), 0, DECODE_VARIANTS[self.decode_variant])
        else:
            ext.prefill(*args, float(scale), True, PREFILL_VARIANTS[self.prefill_variant])
        return out
