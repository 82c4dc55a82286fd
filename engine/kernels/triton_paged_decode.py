"""The split-KV paged decode kernel (Triton) behind TRITON_PAGED attention, reading the paged KV cache in
place (no per-step context copy).

Each program takes one query token, one KV head with all its GQA query heads, and walks fixed 128-token partitions of
that token's context through the block table (512-token ones past 8K tokens of
context); a second kernel merges the partitions by their log-sum-exp. A partition boundary depends only on the
sequence's own length, never on the batch or the launch grid, so results are batch-invariant and identical inside and
outside CUDA graphs.

With MERGE_IN_SPLIT the split kernel merges too, one kernel a layer fewer: each program counts itself
done on its (token, KV head)'s counter (an atomic, after a barrier over its stores), and the program that
finds itself last merges that token's partitions for the head's GQA group, in the same fixed order as the
merge kernel, and puts the counter back to zero for the next launch (so it works inside CUDA graphs). Which
program is last never changes the result.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from onecat.engine.kernels import pdl
from onecat.engine.kernels.triton_fused import rope_halves
from onecat.engine.cache.kv import LayerKVCache
from onecat.engine.switches import switch

PARTITION = 128  # context tokens per split; fixed so numerics never depend on the batch (small enough
#                  that a 1K-token decode already spreads over 8 programs per KV head)
# A sequence past LONG_FROM context tokens splits into LONG_PARTITION-token partitions
# (its own length decides, so rows stay batch-invariant, in CUDA graphs too). Why: at 16K-32K tokens and batch 1 the
# 128-token partitions cost as much in their partials and the merge's second pass as in reading K/V (H100, 64-token
# tiles in two stages: 47 us a layer at 16K with 128-token partitions against 33 us with 512-token ones, every length
# in one size; benchmarks/results/gpu_paged_decode_h100.json). In this form (the wide tile walking a 512-token
# partition) on an H100: 51.7 -> 32.7 us a layer at 16K, batch 1 decode at 16K 147.5 -> 166.8 tok/s
# (results/gpu_paged_decode_long_h100.json). ONECAT_PAGED_LONG_PARTITION=0: 128 tokens at every length (A/B)
LONG_PARTITION = 512 if switch("ONECAT_PAGED_LONG_PARTITION", True) else PARTITION
LONG_FROM = 8192
MERGE_BLOCK = 16  # partitions merged per vector step
BLOCK_N = 64  # context tokens per inner tile, pipelined over 2 stages ...
WIDE_TILE = True  # ... or, up to head_dim 128, the whole partition as one tile in 1 stage: 64 KB of K/V tiles at
#                   most, which every SM80+ block has; faster at one token (benchmarks/results/
#                   gpu_h200_moe_hybrid.json "decode_step_fusions"). The A/B switch.
WIDE_MAX_HEAD_DIM = 128
FP8_KINDS = {torch.float8_e4m3fn: 1, torch.float8_e5m2: 2}  # 8-bit KV storage dtypes the kernel reads
MERGE_ONE_PASS = True  # up to MERGE_BLOCK partitions merged after one load of each: the two-pass loop's arithmetic
#                        with one memory round trip fewer (the A/B switch)
MERGE_IN_SPLIT = switch("ONECAT_MERGE_IN_SPLIT", False)  # the split kernel's last program merges (A/B;
#                        off until measured on a GPU)
COUNTERS_MIN = 1 << 16  # (token, KV head) counters kept per device; zero between launches


# integers that change from step to step (block-table width, context splits) are plain runtime values:
# Triton would otherwise compile a variant for each "== 1" / "divisible by 16" pattern of them
@triton.jit(do_not_specialize=["stride_bt", "max_splits", "splits_per_prog"])
def split_kernel(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr, ctx_ptr, tok_ptr, row_ptr, po_ptr, plse_ptr,
                 out_ptr, cnt_ptr, kv_new_ptr, pos_ptr, cos_ptr, sin_ptr, slot_ptr, qw_ptr, kw_ptr,
                 stride_qt, stride_qh, stride_ot, stride_oh, stride_bt, num_kv_heads, max_splits,
                 splits_per_prog, qk_scale, eps,
                 GROUP: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
                 BLOCK: tl.constexpr, PART: tl.constexpr, LONG_PART: tl.constexpr, LONG_FROM: tl.constexpr,
                 KV_KIND: tl.constexpr, INDIRECT: tl.constexpr,
                 MERGE: tl.constexpr, S_BLOCK: tl.constexpr, ONE_PASS: tl.constexpr, ROPE: tl.constexpr,
                 QK_NORM: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # pdl.py: wait for the previous kernel, then let the next one start
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
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
    part = _partition(ctx, PART, LONG_PART, LONG_FROM)
    n_parts = tl.cdiv(ctx, part)
    if ROPE:  # q and the new k unrotated in the qkv row: rotate them first, q into `out` (see _rotate_new_token)
        _rotate_new_token(q_ptr, kv_new_ptr, k_ptr, v_ptr, out_ptr, pos_ptr, cos_ptr, sin_ptr, slot_ptr, qw_ptr,
                          kw_ptr, tok, kvh, qh, gmask, stride_qt, stride_qh, stride_ot, stride_oh, num_kv_heads, eps,
                          (n_parts - 1) % num_split_progs == first_split, D, QK_NORM)
        q = tl.load(out_ptr + tok * stride_ot + qh[:, None] * stride_oh + d[None, :], mask=gmask[:, None], other=0.0)
    else:
        q = tl.load(q_ptr + tok * stride_qt + qh[:, None] * stride_qh + d[None, :], mask=gmask[:, None], other=0.0)
    for it in range(0, splits_per_prog):
        s = first_split + it * num_split_progs
        if s < n_parts:
            start = s * part
            end = tl.minimum(start + part, ctx)
            m_i = tl.full([G_PAD], float("-inf"), tl.float32)
            l_i = tl.zeros([G_PAD], tl.float32)
            acc = tl.zeros([G_PAD, D], tl.float32)
            for n0 in range(0, part, BLOCK):
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
    if MERGE:
        tl.debug_barrier()  # every thread's partials are stored before the program counts itself done
        counter = cnt_ptr + i * num_kv_heads + kvh
        if tl.atomic_add(counter, 1, sem="acq_rel") == num_split_progs - 1:  # the last: all partials are in
            for g0 in tl.static_range(GROUP):
                h = kvh * GROUP + g0
                _merge_head(out_ptr, po_ptr, plse_ptr, tok, h, n_parts, (i * num_kv_heads * GROUP + h) * max_splits,
                            stride_ot, stride_oh, D, S_BLOCK, ONE_PASS)
            tl.atomic_xchg(counter, 0, sem="relaxed")  # zero again for the next launch


@triton.jit
def _rotate_new_token(q_ptr, kv_new_ptr, k_ptr, v_ptr, out_ptr, pos_ptr, cos_ptr, sin_ptr, slot_ptr, qw_ptr, kw_ptr,
                      tok, kvh, qh, gmask, stride_qt, stride_qh, stride_ot, stride_oh, num_kv_heads, eps, writes_kv,
                      D: tl.constexpr, QK_NORM: tl.constexpr):
    """A decode token's q heads of this program's GQA group normed and rotated as qk_rope_cache does (the same
    rope_halves body, so the same bits) and stored in the attention output's rows, which the merge overwrites later
    (every split program of the group stores the same values there); the program whose splits hold the token's own
    position (`writes_kv`) also rotates the token's k head and stores it and the v head at the token's slot. A
    barrier then makes the stores visible to the program's own loads: q is read back from memory as the kernel reads
    it without this step (a q tile straight from registers lets the compiler take another path into the score
    matmul, which changed a few output bits on an H100), and nothing else reads the new slot in this launch. One
    kernel a layer fewer than rotating and storing in a kernel of their own."""
    half: tl.constexpr = D // 2
    dh = tl.arange(0, half)
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    cos = tl.load(cos_ptr + pos * D + dh)
    sin = tl.load(sin_ptr + pos * D + dh)
    qa = q_ptr + tok * stride_qt + qh[:, None] * stride_qh + dh[None, :]
    x1 = tl.load(qa, mask=gmask[:, None], other=0.0)
    x2 = tl.load(qa + half, mask=gmask[:, None], other=0.0)
    o1, o2 = rope_halves(x1, x2, cos[None, :], sin[None, :], qw_ptr, eps, D, QK_NORM, 1)
    oa = out_ptr + tok * stride_ot + qh[:, None] * stride_oh + dh[None, :]
    tl.store(oa, o1, mask=gmask[:, None])
    tl.store(oa + half, o2, mask=gmask[:, None])
    if writes_kv:
        src = kv_new_ptr + tok * stride_qt + kvh * D  # k heads, then v heads, of the qkv row
        k1, k2 = rope_halves(tl.load(src + dh), tl.load(src + half + dh), cos, sin, kw_ptr, eps, D, QK_NORM, 0)
        dst = (tl.load(slot_ptr + tok).to(tl.int64) * num_kv_heads + kvh) * D
        tl.store(k_ptr + dst + dh, k1)
        tl.store(k_ptr + dst + half + dh, k2)
        full = tl.arange(0, D)
        tl.store(v_ptr + dst + full, tl.load(src + num_kv_heads * D + full))
    tl.debug_barrier()  # the stores above are seen by every thread's loads of this program


@triton.jit
def _merge_head(out_ptr, po_ptr, plse_ptr, tok, h, n_parts, base, stride_ot, stride_oh, D: tl.constexpr,
                S_BLOCK: tl.constexpr, ONE_PASS: tl.constexpr):
    """out[tok, h] from the n_parts partitions stored at `base`: weighted by exp2(lse - max lse), in order."""
    sl = tl.arange(0, S_BLOCK)
    d = tl.arange(0, D)
    m = tl.max(tl.full([S_BLOCK], float("-inf"), tl.float32), 0)
    acc = tl.zeros([D], tl.float32)
    total = tl.sum(tl.zeros([S_BLOCK], tl.float32), 0)
    if ONE_PASS and n_parts <= S_BLOCK:  # the common case: the partitions' lse and outputs loaded at once
        smask = sl < n_parts
        lse = tl.load(plse_ptr + base + sl, mask=smask, other=float("-inf"))
        po = tl.load(po_ptr + (base + sl)[:, None] * D + d[None, :], mask=smask[:, None], other=0.0)
        m = tl.maximum(m, tl.max(lse, 0))
        w = tl.exp2(lse - m)
        acc += tl.sum(w[:, None] * po, 0)
        total += tl.sum(w, 0)
    else:
        for s0 in range(0, n_parts, S_BLOCK):  # S_BLOCK partitions at a time
            lse = tl.load(plse_ptr + base + s0 + sl, mask=s0 + sl < n_parts, other=float("-inf"))
            m = tl.maximum(m, tl.max(lse, 0))
        for s0 in range(0, n_parts, S_BLOCK):
            smask = s0 + sl < n_parts
            w = tl.exp2(tl.load(plse_ptr + base + s0 + sl, mask=smask, other=float("-inf")) - m)
            po = tl.load(po_ptr + (base + s0 + sl)[:, None] * D + d[None, :], mask=smask[:, None], other=0.0)
            acc += tl.sum(w[:, None] * po, 0)
            total += tl.sum(w, 0)
    tl.store(out_ptr + tok * stride_ot + h * stride_oh + d, (acc / total).to(out_ptr.dtype.element_ty))


@triton.jit
def _partition(ctx, PART: tl.constexpr, LONG_PART: tl.constexpr, LONG_FROM: tl.constexpr):
    """The partition size of a sequence of `ctx` context tokens: PART, or LONG_PART past LONG_FROM tokens (its own
    length alone decides, so a row's sums never depend on the batch or the launch)."""
    return tl.where(ctx > LONG_FROM, LONG_PART, PART)


@triton.jit(do_not_specialize=["max_splits"])
def merge_kernel(out_ptr, po_ptr, plse_ptr, ctx_ptr, tok_ptr, stride_ot, stride_oh, num_heads, max_splits,
                 D: tl.constexpr, PART: tl.constexpr, LONG_PART: tl.constexpr, LONG_FROM: tl.constexpr,
                 INDIRECT: tl.constexpr, S_BLOCK: tl.constexpr,
                 ONE_PASS: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # pdl.py: wait for the previous kernel, then let the next one start
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    i = tl.program_id(0)
    h = tl.program_id(1)
    if INDIRECT:
        tok = tl.load(tok_ptr + i).to(tl.int64)
    else:
        tok = i.to(tl.int64)
    ctx = tl.load(ctx_ptr + i)
    n_parts = tl.cdiv(ctx, _partition(ctx, PART, LONG_PART, LONG_FROM))
    _merge_head(out_ptr, po_ptr, plse_ptr, tok, h, n_parts, (i * num_heads + h) * max_splits, stride_ot, stride_oh,
                D, S_BLOCK, ONE_PASS)


_COUNTERS: dict[torch.device, torch.Tensor] = {}


def _counters(device: torch.device, needed: int) -> torch.Tensor:
    """The device's (token, KV head) counters, all zero between launches (each launch's last programs zero
    theirs). Grown outside CUDA-graph capture only: a capture that needs more is refused."""
    have = _COUNTERS.get(device)
    if have is None or have.numel() < needed:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"the paged decode's merge counters hold {0 if have is None else have.numel()} "
                               f"(token, KV head) pairs, this capture needs {needed}; run the step once eagerly "
                               "first (warm-up) so that they are allocated outside the capture")
        _COUNTERS[device] = have = torch.zeros(max(needed, COUNTERS_MIN), dtype=torch.int32, device=device)
    return have


@functools.lru_cache(maxsize=8)
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@dataclass(frozen=True)
class NewTokens:
    """A pure decode step's new tokens as the qkv projection left them (q and k not yet normed or rotated, k
    and v not yet in the cache): what the split kernel needs to do qk_rope_cache's work itself."""
    kv: torch.Tensor  # [T, 2 * Hkv * D] (a view of the qkv rows): k heads, then v heads
    positions: torch.Tensor
    cos: torch.Tensor  # float32 [positions, D]: RotaryEmbedding's tables
    sin: torch.Tensor
    slots: torch.Tensor
    q_weight: torch.Tensor | None  # per-head RMSNorm weights (Qwen3), or None
    k_weight: torch.Tensor | None
    eps: float


def paged_decode(out: torch.Tensor, q: torch.Tensor, cache: LayerKVCache, block_tables: torch.Tensor,
                 ctx_lens: torch.Tensor, max_ctx: int, scale: float, tok_idx: torch.Tensor | None = None,
                 row_idx: torch.Tensor | None = None, new: NewTokens | None = None) -> None:
    """out[tok] = softmax(q[tok] K^T) V over the first ctx_lens[i] cached tokens of block_tables[row].

    Without tok_idx/row_idx, work item i is query row i of sequence i (pure decode). `max_ctx` only
    sizes the launch (pass an upper bound, e.g. max_model_len, when capturing a CUDA graph). With `new` (pure
    decode, a 16-bit cache) q is unrotated and the new tokens' K/V are not yet cached: the kernel norms and
    rotates q and k and stores k and v at their slots (what qk_rope_cache would have done first).
    """
    n = ctx_lens.shape[0]
    if n == 0:
        return
    rows_apart = n > 1 and new is not None and new.kv.stride(0) != q.stride(0)  # (one row's stride is never used)
    if new is not None and (tok_idx is not None or cache.fp8_dtype is not None or rows_apart):
        raise ValueError("paged_decode rotates the new tokens itself only in a pure decode step over a 16-bit cache, "
                         "with q and the new k/v in the same rows")
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
    kind = 0 if cache.fp8_dtype is None else FP8_KINDS[cache.fp8_dtype]
    k, v = cache.k, cache.v
    ks = cache.k_scale if kind else ctx_lens  # dummies are never read when kind == 0
    vs = cache.v_scale if kind else ctx_lens
    indirect = tok_idx is not None
    wide = WIDE_TILE and head_dim <= WIDE_MAX_HEAD_DIM
    launch = pdl.options(q.device)
    tok = tok_idx if indirect else ctx_lens
    row = row_idx if indirect else ctx_lens
    merge_in_split = MERGE_IN_SPLIT
    counters = _counters(q.device, n * num_kv_heads) if merge_in_split else ctx_lens  # a dummy when unread
    rot = new if new is not None else NewTokens(q, ctx_lens, q, q, ctx_lens, None, None, 0.0)  # dummies: unread
    norm = rot.q_weight is not None
    split_kernel[(n, num_kv_heads, split_progs)](
        q, k, v, ks, vs, block_tables, ctx_lens, tok, row, po, plse, out, counters, rot.kv, rot.positions, rot.cos,
        rot.sin, rot.slots, rot.q_weight if norm else q, rot.k_weight if norm else q,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0), num_kv_heads, max_splits,
        per_prog, float(scale) * 1.4426950408889634, rot.eps,
        GROUP=group, G_PAD=max(16, 1 << (group - 1).bit_length()), D=head_dim, PAGE=page,
        BLOCK=PARTITION if wide else BLOCK_N, PART=PARTITION, LONG_PART=LONG_PARTITION, LONG_FROM=LONG_FROM,
        KV_KIND=kind, INDIRECT=indirect,
        MERGE=merge_in_split, S_BLOCK=MERGE_BLOCK, ONE_PASS=MERGE_ONE_PASS, ROPE=new is not None, QK_NORM=norm,
        num_warps=4, num_stages=1 if wide else 2, **launch)
    if not merge_in_split:
        merge_kernel[(n, num_heads)](out, po, plse, ctx_lens, tok, out.stride(0), out.stride(1), num_heads,
                                     max_splits, D=head_dim, PART=PARTITION, LONG_PART=LONG_PARTITION,
                                     LONG_FROM=LONG_FROM, INDIRECT=indirect, S_BLOCK=MERGE_BLOCK,
                                     ONE_PASS=MERGE_ONE_PASS, num_warps=2, **launch)
