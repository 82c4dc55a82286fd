"""Attention of a DFlash drafter's block (Triton): each request's B block rows over its context's keys (the
first ctx_len rows of a padded context buffer) and the block's own keys, all visible, read where they lie.

Why: the block forward's attention was scaled_dot_product_attention over torch.cat([context, block]) with a
padding mask, the query heads regrouped per KV head (two concatenations, a layout copy in and out, the mask's
few kernels a layer). Its kernel ran one program per (request, KV head), each walking every context key in turn:
on the 8B shape 16.6 us a layer for ~2 MB of keys and values, on route 1's drafter (head size 256) ~110 us. Here
programs split the keys into parts (at most MAX_CONTEXT_PARTS of the context, walked PART rows at a time with an
online softmax; the block's own rows a part of their own), one program per (request, query head, part), and a
second kernel merges the parts by their log-sum-exp into o_proj's input layout. The
grid depends only on the buffer's context size, so one launch serves a CUDA graph whatever the lengths.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

PART = 64  # keys per program on SM80+ (a tl.dot needs 16 or more)
# SM70 (V100): Triton lowers tl.dot to FMAs there; 16 keys a program and 8 warps is the tiling whose sm_70 build
# does not spill at head size 128 (`onecat kernels check`: 64 keys spill 6 KB a thread at 4 warps, 324 B at 8);
# at head size 256 every tiling tried spilled (112 B to 35 KB), so a V100 drafter of that head size keeps
# scaled_dot_product_attention (config() is None)
SM70_PART, SM70_WARPS, SM70_MAX_HEAD_DIM = 16, 8, 128
# context parts a (request, head) is split into at most: a longer context gives each program more PART-row tiles
# (an online softmax over them) instead of more partials, which cost B_PAD x head size floats each (16 rows x 32
# heads of 4,096 context rows in 64-row parts would have been 272 MB of partials on the 8B shape; 8 parts: 38 MB)
MAX_CONTEXT_PARTS = 8


def config(head_dim: int, capability: int) -> tuple[int, int] | None:
    """(keys a program, warps) for the split kernel on a device of `capability` (10 * major + minor), or None:
    the kernel is not launched there."""
    if capability >= 80:
        return PART, 4 if head_dim <= 128 else 8
    return (SM70_PART, SM70_WARPS) if head_dim <= SM70_MAX_HEAD_DIM else None


@triton.jit
def block_attention_split_kernel(qkv_ptr, kc_ptr, vc_ptr, len_ptr, po_ptr, pm_ptr, pl_ptr,
                                 stride_t, stride_kr, stride_kc, stride_vr, stride_vc, num_heads, num_kv_heads,
                                 ctx_parts, chunk, n_parts, qk_scale,
                                 B: tl.constexpr, B_PAD: tl.constexpr, D: tl.constexpr, PART: tl.constexpr,
                                 PRECISION: tl.constexpr):
    rh = tl.program_id(0)
    s = tl.program_id(1)
    r = rh // num_heads
    h = rh % num_heads
    kvh = h // (num_heads // num_kv_heads)
    b = tl.arange(0, B_PAD)
    d = tl.arange(0, D)
    c = tl.arange(0, PART)
    q = tl.load(qkv_ptr + (r * B + b)[:, None] * stride_t + h * D + d[None, :], mask=(b < B)[:, None], other=0.0)
    if s < ctx_parts:  # `chunk` context rows, those below the request's length, PART at a time
        first = s * chunk
        stop = tl.minimum(first + chunk, tl.load(len_ptr + r))
        k_base = kc_ptr + r * stride_kr + kvh * D
        v_base = vc_ptr + r * stride_vr + kvh * D
        k_stride = stride_kc
        v_stride = stride_vc
    else:  # PART of the block's own rows (q/k/v rows of the qkv projection), every one visible
        first = (s - ctx_parts) * PART
        stop = tl.minimum(first + PART, B)
        k_base = qkv_ptr + r * B * stride_t + (num_heads + kvh) * D
        v_base = qkv_ptr + r * B * stride_t + (num_heads + num_kv_heads + kvh) * D
        k_stride = stride_t
        v_stride = stride_t
    m = tl.full([B_PAD], float("-inf"), tl.float32)
    l_sum = tl.zeros([B_PAD], tl.float32)
    acc = tl.zeros([B_PAD, D], tl.float32)
    for start in range(first, stop, PART):  # online softmax over the part's tiles (none: an empty part)
        rows = start + c
        live = rows < stop
        k = tl.load(k_base + rows[:, None] * k_stride + d[None, :], mask=live[:, None], other=0.0)
        v = tl.load(v_base + rows[:, None] * v_stride + d[None, :], mask=live[:, None], other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # log2 units
        scores = tl.where(live[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_sum = l_sum * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = m_new
    part = rh * n_parts + s
    tl.store(po_ptr + (part * B_PAD + b)[:, None] * D + d[None, :], acc)
    tl.store(pm_ptr + part * B_PAD + b, m)
    tl.store(pl_ptr + part * B_PAD + b, l_sum)


@triton.jit
def block_attention_merge_kernel(po_ptr, pm_ptr, pl_ptr, out_ptr, stride_ot, num_heads, n_parts,
                                 B: tl.constexpr, B_PAD: tl.constexpr, D: tl.constexpr):
    rh = tl.program_id(0)
    r = rh // num_heads
    h = rh % num_heads
    b = tl.arange(0, B_PAD)
    d = tl.arange(0, D)
    top = tl.full([B_PAD], float("-inf"), tl.float32)
    for s in range(0, n_parts):
        top = tl.maximum(top, tl.load(pm_ptr + (rh * n_parts + s) * B_PAD + b))
    total = tl.zeros([B_PAD], tl.float32)
    acc = tl.zeros([B_PAD, D], tl.float32)
    for s in range(0, n_parts):
        part = rh * n_parts + s
        w = tl.exp2(tl.load(pm_ptr + part * B_PAD + b) - top)  # an empty part: exp2(-inf) = 0
        total += w * tl.load(pl_ptr + part * B_PAD + b)
        acc += w[:, None] * tl.load(po_ptr + (part * B_PAD + b)[:, None] * D + d[None, :])
    out = acc / total[:, None]
    tl.store(out_ptr + (r * B + b)[:, None] * stride_ot + h * D + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=(b < B)[:, None])


def block_attention(qkv: torch.Tensor, k_ctx: torch.Tensor, v_ctx: torch.Tensor, ctx_len: torch.Tensor,
                    num_heads: int, num_kv_heads: int, head_dim: int, block: int, scale: float,
                    tiling: tuple[int, int] = (PART, 4)) -> torch.Tensor:
    """qkv [R * block, (num_heads + 2 num_kv_heads) head_dim] (q and k normed and rotated), k_ctx / v_ctx
    [R, C, num_kv_heads, head_dim] (any row stride), ctx_len [R] -> [R * block, num_heads * head_dim]: each
    block row's attention over its request's first ctx_len context rows and the whole block."""
    T = qkv.shape[0]
    R, C = k_ctx.shape[0], k_ctx.shape[1]
    assert T == R * block and qkv.stride(1) == 1 and k_ctx.stride(-1) == 1 and v_ctx.stride(-1) == 1
    assert k_ctx.stride(2) == head_dim and v_ctx.stride(2) == head_dim and ctx_len.dtype == torch.int32
    assert head_dim == triton.next_power_of_2(head_dim) and k_ctx.dtype == v_ctx.dtype == qkv.dtype
    part, warps = tiling
    b_pad = max(16, triton.next_power_of_2(block))
    chunk = part * triton.cdiv(triton.cdiv(C, part), MAX_CONTEXT_PARTS)  # context rows a program: PART-row tiles
    ctx_parts = triton.cdiv(C, chunk)
    n_parts = ctx_parts + triton.cdiv(block, part)
    dev = qkv.device
    po = torch.empty(R * num_heads * n_parts * b_pad * head_dim, dtype=torch.float32, device=dev)
    pm = torch.empty(R * num_heads * n_parts * b_pad, dtype=torch.float32, device=dev)
    pl = torch.empty_like(pm)
    out = torch.empty(T, num_heads * head_dim, dtype=qkv.dtype, device=dev)
    if T == 0:
        return out
    block_attention_split_kernel[(R * num_heads, n_parts)](
        qkv, k_ctx, v_ctx, ctx_len, po, pm, pl, qkv.stride(0), k_ctx.stride(0), k_ctx.stride(1), v_ctx.stride(0),
        v_ctx.stride(1), num_heads, num_kv_heads, ctx_parts, chunk, n_parts, scale * 1.4426950408889634,
        B=block, B_PAD=b_pad, D=head_dim, PART=part,
        PRECISION="ieee" if qkv.dtype == torch.float32 else "tf32", num_warps=warps)
    block_attention_merge_kernel[(R * num_heads,)](po, pm, pl, out, out.stride(0), num_heads, n_parts,
                                                   B=block, B_PAD=b_pad, D=head_dim, num_warps=warps)
    return out
