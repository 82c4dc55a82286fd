"""TRITON_PAGED: SM80+ attention that reads the paged KV cache in place (no per-step context copy).

Decode (and short verify chunks) go through a split-KV Triton kernel: each program takes one query
token, one KV head with all its GQA query heads, and walks fixed 128-token partitions of that
token's context through the block table; a second kernel merges the partitions by their
log-sum-exp. A partition boundary depends only on the sequence's own length, never on the batch
or the launch grid, so results are batch-invariant and identical inside and outside CUDA graphs.
Long prefill chunks go through torch SDPA per sequence (causal on the fresh tokens when nothing
is cached; otherwise an explicit mask over the gathered context).

Triton is imported lazily: this module imports on machines without it, and the backend then
reports why it cannot run so the dispatcher falls back to the reference path.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from onecat.engine.attention.backend import AttentionBackend
from onecat.engine.attention.metadata import AttentionMetadata
from onecat.engine.kv_cache import LayerKVCache, dequantize_fp8

PARTITION = 128  # context tokens per split; fixed so numerics never depend on the batch (small enough
#                  that a 1K-token decode already spreads over 8 programs per KV head)
MERGE_BLOCK = 16  # partitions merged per vector step
BLOCK_N = 64  # context tokens per inner tile
SHORT_QUERY = 16  # chunks up to this many tokens (decode, speculative verify) use the paged kernel
_FP8_KINDS = {torch.float8_e4m3fn: 1, torch.float8_e5m2: 2}


@functools.lru_cache(maxsize=1)
def triton_unavailable_reason() -> str | None:
    try:
        import triton  # noqa: F401
    except Exception as e:  # ImportError, or a broken install
        return f"triton is not importable ({type(e).__name__}: {e})"
    return None


@functools.lru_cache(maxsize=1)
def _kernels():
    """Compiles nothing yet: defines the two jitted kernels on first use."""
    import triton
    import triton.language as tl

    @triton.jit
    def split_kernel(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr, ctx_ptr, tok_ptr, row_ptr, po_ptr, plse_ptr,
                     stride_qt, stride_qh, stride_bt, num_kv_heads, max_splits, splits_per_prog, qk_scale,
                     GROUP: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
                     BLOCK: tl.constexpr, PART: tl.constexpr, KV_KIND: tl.constexpr, INDIRECT: tl.constexpr):
        i = tl.program_id(0)
        kvh = tl.program_id(1)
        first_split = tl.program_id(2)
        num_split_progs = tl.num_programs(2)
        if INDIRECT:
            tok = tl.load(tok_ptr + i).to(tl.int64)
            row = tl.load(row_ptr + i).to(tl.int64)
        else:
            tok = i.to(tl.int64)
            row = i.to(tl.int64)
        ctx = tl.load(ctx_ptr + i)
        g = tl.arange(0, G_PAD)
        d = tl.arange(0, D)
        gmask = g < GROUP
        qh = kvh * GROUP + g
        q = tl.load(q_ptr + tok * stride_qt + qh[:, None] * stride_qh + d[None, :], mask=gmask[:, None], other=0.0)
        n_parts = tl.cdiv(ctx, PART)
        for it in range(0, splits_per_prog):
            s = first_split + it * num_split_progs
            if s < n_parts:
                start = s * PART
                end = tl.minimum(start + PART, ctx)
                m_i = tl.full([G_PAD], float("-inf"), tl.float32)
                l_i = tl.zeros([G_PAD], tl.float32)
                acc = tl.zeros([G_PAD, D], tl.float32)
                for n0 in range(0, PART, BLOCK):
                    offs = start + n0 + tl.arange(0, BLOCK)
                    nmask = offs < end
                    page = tl.load(bt_ptr + row * stride_bt + offs // PAGE, mask=nmask, other=0).to(tl.int64)
                    slot = page * PAGE + offs % PAGE
                    kv_off = (slot * num_kv_heads + kvh) * D
                    k = tl.load(k_ptr + kv_off[:, None] + d[None, :], mask=nmask[:, None], other=0)
                    v = tl.load(v_ptr + kv_off[:, None] + d[None, :], mask=nmask[:, None], other=0)
                    if KV_KIND != 0:
                        ks = tl.load(ks_ptr + slot * num_kv_heads + kvh, mask=nmask, other=0.0)
                        vs = tl.load(vs_ptr + slot * num_kv_heads + kvh, mask=nmask, other=0.0)
                        if KV_KIND == 1:
                            k = k.to(tl.float8e4nv, bitcast=True)
                            v = v.to(tl.float8e4nv, bitcast=True)
                        else:
                            k = k.to(tl.float8e5, bitcast=True)
                            v = v.to(tl.float8e5, bitcast=True)
                        k = (k.to(tl.float32) * ks[:, None]).to(q.dtype)
                        v = (v.to(tl.float32) * vs[:, None]).to(q.dtype)
                    sc = tl.dot(q, tl.trans(k)) * qk_scale  # log2 units
                    sc = tl.where(nmask[None, :], sc, float("-inf"))
                    m_new = tl.maximum(m_i, tl.max(sc, 1))
                    alpha = tl.exp2(m_i - m_new)
                    p = tl.exp2(sc - m_new[:, None])
                    l_i = l_i * alpha + tl.sum(p, 1)
                    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v)
                    m_i = m_new
                base = (i * num_kv_heads * GROUP + qh) * max_splits + s
                tl.store(po_ptr + base[:, None] * D + d[None, :], acc / l_i[:, None], mask=gmask[:, None])
                tl.store(plse_ptr + base, m_i + tl.log2(l_i), mask=gmask)

    @triton.jit
    def merge_kernel(out_ptr, po_ptr, plse_ptr, ctx_ptr, tok_ptr, stride_ot, stride_oh, num_heads, max_splits,
                     D: tl.constexpr, PART: tl.constexpr, INDIRECT: tl.constexpr, S_BLOCK: tl.constexpr):
        i = tl.program_id(0)
        h = tl.program_id(1)
        if INDIRECT:
            tok = tl.load(tok_ptr + i).to(tl.int64)
        else:
            tok = i.to(tl.int64)
        n_parts = tl.cdiv(tl.load(ctx_ptr + i), PART)
        base = (i * num_heads + h) * max_splits
        sl = tl.arange(0, S_BLOCK)
        m = tl.max(tl.full([S_BLOCK], float("-inf"), tl.float32), 0)
        for s0 in range(0, n_parts, S_BLOCK):  # S_BLOCK partitions at a time
            lse = tl.load(plse_ptr + base + s0 + sl, mask=s0 + sl < n_parts, other=float("-inf"))
            m = tl.maximum(m, tl.max(lse, 0))
        d = tl.arange(0, D)
        acc = tl.zeros([D], tl.float32)
        total = tl.sum(tl.zeros([S_BLOCK], tl.float32), 0)
        for s0 in range(0, n_parts, S_BLOCK):
            smask = s0 + sl < n_parts
            w = tl.exp2(tl.load(plse_ptr + base + s0 + sl, mask=smask, other=float("-inf")) - m)
            po = tl.load(po_ptr + (base + s0 + sl)[:, None] * D + d[None, :], mask=smask[:, None], other=0.0)
            acc += tl.sum(w[:, None] * po, 0)
            total += tl.sum(w, 0)
        tl.store(out_ptr + tok * stride_ot + h * stride_oh + d, (acc / total).to(out_ptr.dtype.element_ty))

    return split_kernel, merge_kernel


@functools.lru_cache(maxsize=8)
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def paged_decode(out: torch.Tensor, q: torch.Tensor, cache: LayerKVCache, block_tables: torch.Tensor,
                 ctx_lens: torch.Tensor, max_ctx: int, scale: float, tok_idx: torch.Tensor | None = None,
                 row_idx: torch.Tensor | None = None) -> None:
    """out[tok] = softmax(q[tok] K^T) V over the first ctx_lens[i] cached tokens of block_tables[row].

    Without tok_idx/row_idx, work item i is query row i of sequence i (pure decode). `max_ctx` only
    sizes the launch (pass an upper bound, e.g. max_model_len, when capturing a CUDA graph).
    """
    split_kernel, merge_kernel = _kernels()
    n = ctx_lens.shape[0]
    if n == 0:
        return
    _, num_heads, head_dim = q.shape
    num_kv_heads, page = cache.k.shape[2], cache.k.shape[1]
    group = num_heads // num_kv_heads
    max_splits = max(1, -(-max_ctx // PARTITION))
    # enough programs to fill the chip; each program strides over its splits (same partitions either way)
    sms = _num_sms(q.device.index or 0) if q.device.type == "cuda" else 4
    split_progs = max(1, min(max_splits, -(-4 * sms // (n * num_kv_heads))))
    per_prog = -(-max_splits // split_progs)
    po = torch.empty((n, num_heads, max_splits, head_dim), dtype=torch.float32, device=q.device)
    plse = torch.empty((n, num_heads, max_splits), dtype=torch.float32, device=q.device)
    kind = 0 if cache.fp8_dtype is None else _FP8_KINDS[cache.fp8_dtype]
    k, v = cache.k, cache.v
    ks = cache.k_scale if kind else ctx_lens  # dummies are never read when kind == 0
    vs = cache.v_scale if kind else ctx_lens
    indirect = tok_idx is not None
    tok = tok_idx if indirect else ctx_lens
    row = row_idx if indirect else ctx_lens
    split_kernel[(n, num_kv_heads, split_progs)](
        q, k, v, ks, vs, block_tables, ctx_lens, tok, row, po, plse,
        q.stride(0), q.stride(1), block_tables.stride(0), num_kv_heads, max_splits, per_prog,
        float(scale) * 1.4426950408889634,
        GROUP=group, G_PAD=max(16, 1 << (group - 1).bit_length()), D=head_dim, PAGE=page, BLOCK=BLOCK_N,
        PART=PARTITION, KV_KIND=kind, INDIRECT=indirect, num_warps=4, num_stages=2)
    merge_kernel[(n, num_heads)](out, po, plse, ctx_lens, tok, out.stride(0), out.stride(1), num_heads, max_splits,
                                 D=head_dim, PART=PARTITION, INDIRECT=indirect, S_BLOCK=MERGE_BLOCK, num_warps=2)


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
    packed = torch.tensor([toks, rows, ctxs], dtype=torch.int32).to(device, non_blocking=True)
    layout = {"tok": packed[0], "row": packed[1], "ctx": packed[2], "long": long_seqs,
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
    out = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
                                         v.transpose(0, 1).unsqueeze(0), attn_mask=mask, is_causal=prefix == 0,
                                         scale=scale)
    return out[0].transpose(0, 1)


class TritonPagedBackend(AttentionBackend):
    name = "TRITON_PAGED"
    graph_safe = True  # pure-decode calls do no host syncs and size launches from shapes alone

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
        if cache.fp8_dtype is None:
            if k.dtype != q.dtype:
                return f"KV cache dtype {k.dtype} differs from the query dtype {q.dtype}"
        elif cache.fp8_dtype not in _FP8_KINDS or k.element_size() != 1:
            return f"8-bit KV cache of {cache.fp8_dtype} unsupported: float8_e4m3fn or float8_e5m2 bytes"
        elif cache.k_scale is None or not (cache.k_scale.is_contiguous() and cache.v_scale.is_contiguous()):
            return "8-bit KV cache needs contiguous float32 k_scale/v_scale"
        if meta.block_tables.dtype != torch.int32 or meta.seq_lens.dtype != torch.int32:
            return "metadata block_tables/seq_lens must be int32"
        return None

    def forward(self, q: torch.Tensor, cache: LayerKVCache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
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
