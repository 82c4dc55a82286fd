"""TRITON_PAGED: SM80+ attention that reads the paged KV cache in place (no per-step context copy).

Decode (and short verify chunks) go through the split-KV Triton kernel of
engine/kernels/triton_paged_decode.py (batch-invariant, identical inside and outside CUDA graphs).
Long prefill chunks go through torch SDPA per sequence (causal on the fresh tokens when nothing
is cached; otherwise an explicit mask over the gathered context).

Triton is imported lazily: this module imports on machines without it, and the backend then
reports why it cannot run so the dispatcher falls back to the reference path.
"""
from __future__ import annotations

import torch

from onecat.engine.attention.backend import AttentionBackend
from onecat.engine.attention.metadata import AttentionMetadata
from onecat.engine.attention.sdpa import sdpa
from onecat.engine.cache.kv import LayerKVCache, dequantize_fp8
from onecat.engine.kernels.triton_support import triton_unavailable_reason
from onecat.engine.switches import switch
from onecat.engine.transfers import to_device

SHORT_QUERY = 16  # chunks up to this many tokens (decode, speculative verify) use the paged kernel
# a pure decode step's q/k norm, RoPE and K/V store done by the split kernel instead of a kernel of their own
# (on: the same bits as the two-kernel path on an H100, embedded shape 1.055x at batch 1; 0 for the A/B)
ROPE_IN_SPLIT = switch("ONECAT_ROPE_IN_SPLIT", True)


def _short_rows(meta: AttentionMetadata, device: torch.device) -> dict:
    """Per-token work items for the short chunks of a mixed step, built once per step for all layers."""
    cached = meta.extras.get("triton_paged")
    if cached is not None:
        return cached
    toks, rows, ctxs, long_seqs = [], [], [], []
    start = 0
    for b, (n, s) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
        if n <= SHORT_QUERY:
            toks.extend(range(start, start + n))
            rows.extend([b] * n)
            ctxs.extend(range(s - n + 1, s + 1))
        else:
            long_seqs.append((b, start, n, s))
        start += n
    # rows padded to 16 bytes: an unaligned row pointer would make Triton compile another variant
    width = -(-len(toks) // 4) * 4
    pad = [0] * (width - len(toks))
    packed = to_device([toks + pad, rows + pad, ctxs + pad], device, torch.int32)
    n = len(toks)
    layout = {"tok": packed[0, :n], "row": packed[1, :n], "ctx": packed[2, :n], "long": long_seqs,
              "max_ctx": max(ctxs) if ctxs else 0}
    meta.extras["triton_paged"] = layout
    return layout


def _sdpa_chunk(q: torch.Tensor, cache: LayerKVCache, meta: AttentionMetadata, b: int, start: int, n: int,
                seq_len: int, scale: float) -> torch.Tensor:
    """One sequence's prefill chunk through torch SDPA; q: [n, Hq, D] -> [n, Hq, D]."""
    Hkv, D = cache.k.shape[2], cache.k.shape[3]
    prefix = seq_len - n
    bs = meta.block_size
    if prefix == 0:  # only fresh tokens: read back exactly what was just written
        slots = meta.slot_mapping[start:start + n]
    else:
        pages = meta.block_tables[b, :-(-seq_len // bs)].to(torch.int64)
        slots = (pages.unsqueeze(1) * bs + torch.arange(bs, device=q.device)).reshape(-1)[:seq_len]
    k = cache.k.view(-1, Hkv, D).index_select(0, slots)
    v = cache.v.view(-1, Hkv, D).index_select(0, slots)
    if cache.is_fp8:
        k = dequantize_fp8(k, cache.k_scale.view(-1, Hkv).index_select(0, slots), cache.fp8_dtype, q.dtype)
        v = dequantize_fp8(v, cache.v_scale.view(-1, Hkv).index_select(0, slots), cache.fp8_dtype, q.dtype)
    mask = None
    if prefix:
        i = torch.arange(n, device=q.device).unsqueeze(1)
        mask = torch.arange(seq_len, device=q.device).unsqueeze(0) <= i + prefix
    group = q.shape[1] // Hkv
    if group > 1:  # expanded here so every SDPA kernel (flash, mem-efficient with a mask) accepts it
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    out = sdpa(q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0),
               attn_mask=mask, is_causal=prefix == 0, scale=scale)
    return out[0].transpose(0, 1)


class TritonPagedBackend(AttentionBackend):
    name = "TRITON_PAGED"
    graph_safe = True  # pure-decode calls do no host syncs and size launches from shapes alone
    graph_safe_verify = True  # so are short uniform chunks, given their work items (`verify_layout`)

    @staticmethod
    def verify_layout(meta: AttentionMetadata, tok: torch.Tensor, row: torch.Tensor, ctx: torch.Tensor,
                      max_ctx: int) -> None:
        """Hand a CUDA graph's static work items to this step's attention calls (instead of building them
        on the host): token tok[i] of sequence row[i] attends to the first ctx[i] cached tokens; `max_ctx`
        bounds every ctx (it sizes the launch)."""
        meta.extras["triton_paged"] = {"tok": tok, "row": row, "ctx": ctx, "long": [], "max_ctx": max_ctx}

    def unsupported_reason(self, q: torch.Tensor, cache: LayerKVCache, meta: AttentionMetadata) -> str | None:
        if q.device.type != "cuda":
            return f"query tensor is on {q.device}, not a CUDA device"
        reason = triton_unavailable_reason()
        if reason is not None:
            return reason
        major, minor = torch.cuda.get_device_capability(q.device)
        if major < 8:
            return f"compute capability {major}.{minor} < 8.0 (use FLASH_ATTN_V100 on SM70)"
        if q.dtype not in (torch.float16, torch.bfloat16):
            return f"dtype {q.dtype} unsupported: the kernel takes float16 or bfloat16 queries"
        if q.dim() != 3 or q.stride(-1) != 1:
            return "query must be a [tokens, heads, head_dim] tensor with a unit last stride"
        head_dim = q.shape[-1]
        if head_dim < 16 or head_dim > 256 or head_dim & (head_dim - 1):
            return f"head_dim {head_dim} unsupported: a power of two in [16, 256]"
        k, v = cache.k, cache.v
        if k.dim() != 4 or k.shape != v.shape or k.shape[-1] != head_dim:
            return "KV cache must be [num_blocks, block_size, num_kv_heads, head_dim] matching the query"
        if not (k.is_contiguous() and v.is_contiguous()):
            return "KV cache tensors must be contiguous"
        if q.shape[1] % k.shape[2]:
            return f"num_heads {q.shape[1]} is not a multiple of num_kv_heads {k.shape[2]}"
        from onecat.engine.kernels.triton_paged_decode import FP8_KINDS

        if cache.fp8_dtype is None:
            if k.dtype != q.dtype:
                return f"KV cache dtype {k.dtype} differs from the query dtype {q.dtype}"
        elif cache.fp8_dtype not in FP8_KINDS or k.element_size() != 1:
            return f"8-bit KV cache of {cache.fp8_dtype} unsupported: float8_e4m3fn or float8_e5m2 bytes"
        elif cache.k_scale is None or not (cache.k_scale.is_contiguous() and cache.v_scale.is_contiguous()):
            return "8-bit KV cache needs contiguous float32 k_scale/v_scale"
        if meta.block_tables.dtype != torch.int32 or meta.seq_lens.dtype != torch.int32:
            return "metadata block_tables/seq_lens must be int32"
        return None

    @staticmethod
    def takes_new_tokens(cache: LayerKVCache, meta: AttentionMetadata) -> bool:
        """Whether forward_new_tokens runs this step: ONECAT_ROPE_IN_SPLIT on, pure decode, a 16-bit cache."""
        return ROPE_IN_SPLIT and meta.max_query_len == 1 and cache.fp8_dtype is None

    def forward_new_tokens(self, q: torch.Tensor, new, cache: LayerKVCache, meta: AttentionMetadata,
                           scale: float) -> torch.Tensor:
        """Attention of a pure decode step whose q and new K/V are as the qkv projection left them (`new`, a
        triton_paged_decode.NewTokens): the split kernel norms, rotates and stores them itself."""
        from onecat.engine.kernels.triton_paged_decode import paged_decode

        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        paged_decode(out, q, cache, meta.block_tables, meta.seq_lens, meta.max_seq_len, scale, new=new)
        return out

    def forward(self, q: torch.Tensor, cache: LayerKVCache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        from onecat.engine.kernels.triton_paged_decode import paged_decode

        out = torch.empty_like(q)
        if meta.max_query_len == 1:  # pure decode: one work item per sequence, straight from the metadata
            paged_decode(out, q, cache, meta.block_tables, meta.seq_lens, meta.max_seq_len, scale)
            return out
        lay = _short_rows(meta, q.device)
        if lay["tok"].numel():
            paged_decode(out, q, cache, meta.block_tables, lay["ctx"], lay["max_ctx"], scale, lay["tok"],
                         lay["row"])
        for b, start, n, seq_len in lay["long"]:
            out[start:start + n] = _sdpa_chunk(q[start:start + n], cache, meta, b, start, n, seq_len, scale)
        return out
