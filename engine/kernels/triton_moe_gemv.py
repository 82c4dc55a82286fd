"""Fused MoE experts at decode (Triton): every (token, expert) pair as its own GEMV, no sort.

At decode a step has a few tokens, each routed to k experts; most experts get one pair or none. The grouped
GEMM of triton_moe.py pads each expert's pairs to a 16-row block for the tensor cores and stages the weights
through shared memory; at one token that streams the active experts' weights at about three quarters of the
copy rate. Here each pair is one program column, as a row of the dense GEMV (triton_gemv.py): its expert's
weight rows are loaded in wide tiles straight into registers, multiplied in float32 and reduced once at the
end. A pair's sums therefore never depend on the other pairs of the step: a token decoded alone gets the
bits it gets in a batch. Pairs that share an expert read its rows again; the pair index is the fastest grid
axis, so those reads come from L2 while the column block is still there (row blocks fastest was slower at
batch 8: 936 against 1024 tok/s).

  gate_up  program (pair p, column block): SiLU(gate) * up for p's expert and token, rounded as the grouped
           kernel rounds it.
  down     program (token t, column block): the rows of all t's k pairs as one [k, rows, K] tile, so every
           expert's rows are in flight at once (a loop over the k experts, one after the other, streamed
           them at about 2.3 TB/s: 410 against 422 tok/s on the whole model); each pair's row rounded to the
           model dtype, scaled by its router weight and rounded again, as the grouped path rounds it; the k
           then summed in float32 by a fixed reduction and rounded once, without the pairs' rows going
           through memory.

Only plain multiply-adds: the same kernels run on SM70.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from onecat.engine.kernels import pdl

MAX_TOKENS = 16  # tokens up to which the step's experts run as GEMVs; more take the grouped GEMM


def k_pad(top_k: int) -> int:
    """The down kernel's slot axis: top_k rounded up to a power of two (Triton tile sizes)."""
    return max(2, 1 << (top_k - 1).bit_length())


def config(k: int, glu: bool = False) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps) for an input of k features. Measured on an H200 at the Qwen3-30B-A3B shape
    (benchmarks/results/gpu_h200_moe_hybrid.json "moe_decode_gemv"): gate_up with one gate and one up row a
    program in 1024-wide tiles, down with two output rows of each of the k pairs a program in 256-wide tiles,
    two warps each."""
    if glu:
        return 1, min(1024, 1 << (k - 1).bit_length()), 2
    return 2, min(256, 1 << (k - 1).bit_length()), 2


@triton.jit
def _row_dots(w_ptr, x_ptr, rows, K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """[BLOCK_N] float32: rows of a [*, K] weight times x, elementwise partials reduced once at the end."""
    cols = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in tl.static_range(0, K, BLOCK_K):
        c = k0 + cols
        ok = c < K
        w = tl.load(w_ptr + rows[:, None] * K + c[None, :], mask=ok[None, :], other=0.0,
                    eviction_policy="evict_first")
        xv = tl.load(x_ptr + c, mask=ok, other=0.0)
        acc += w.to(tl.float32) * xv.to(tl.float32)[None, :]
    return tl.sum(acc, axis=1)

@triton.jit
def gate_up_kernel(x_ptr, w_ptr, ids_ptr, h_ptr, top_k, inter, stride_we,
                   K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # pdl.py: the expert ids come from the router, so nothing is loaded before the wait
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    p = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < inter
    rows = tl.where(row_ok, rows, 0).to(tl.int64)
    e = tl.load(ids_ptr + p).to(tl.int64)
    x_row = x_ptr + (p // top_k) * K
    w_e = w_ptr + e * stride_we
    g = _row_dots(w_e, x_row, rows, K, BLOCK_N, BLOCK_K)
    u = _row_dots(w_e, x_row, rows + inter, K, BLOCK_N, BLOCK_K)
    dt = h_ptr.dtype.element_ty
    gate = g.to(dt).to(tl.float32)  # the projection's output rounding, as the grouped kernel
    act = (gate / (1.0 + tl.exp(-gate))).to(dt)
    tl.store(h_ptr + p * inter + rows, act * u.to(dt), mask=row_ok)

@triton.jit
def down_kernel(h_ptr, w_ptr, ids_ptr, route_ptr, out_ptr, H, stride_we,
                K: tl.constexpr, TOP_K: tl.constexpr, K_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    t = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < H
    rows = tl.where(row_ok, rows, 0).to(tl.int64)
    slots = tl.arange(0, K_PAD)
    slot_ok = slots < TOP_K
    pairs = t * TOP_K + tl.where(slot_ok, slots, 0)
    e = tl.load(ids_ptr + pairs).to(tl.int64)
    w_rows = w_ptr + e[:, None, None] * stride_we + rows[None, :, None] * K  # [K_PAD, BLOCK_N, 1]
    cols = tl.arange(0, BLOCK_K)
    acc = tl.zeros([K_PAD, BLOCK_N, BLOCK_K], tl.float32)
    for k0 in tl.static_range(0, K, BLOCK_K):  # every slot's rows in one tile: all in flight at once
        c = k0 + cols
        ok = c < K
        w = tl.load(w_rows + c[None, None, :], mask=slot_ok[:, None, None] & ok[None, None, :], other=0.0,
                    eviction_policy="evict_first")
        hv = tl.load(h_ptr + pairs[:, None] * K + c[None, :], mask=slot_ok[:, None] & ok[None, :], other=0.0)
        acc += w.to(tl.float32) * hv.to(tl.float32)[:, None, :]
    dt = out_ptr.dtype.element_ty
    scale = tl.load(route_ptr + pairs, mask=slot_ok, other=0.0).to(tl.float32)
    y = (tl.sum(acc, axis=2).to(dt).to(tl.float32) * scale[:, None]).to(dt).to(tl.float32)
    total = tl.sum(tl.where(slot_ok[:, None], y, 0.0), axis=0)
    tl.store(out_ptr + t * H + rows, total.to(dt), mask=row_ok)


def fused_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor,
                  ids: torch.Tensor) -> torch.Tensor:
    """triton_moe.fused_experts for T <= MAX_TOKENS (the caller checks shapes and dtypes): x [T, H] contiguous,
    gate_up [E, 2I, H], down [E, H, I] contiguous; weights, ids [T, k] -> [T, H]."""
    T, top_k = ids.shape
    _, two_i, H = gate_up.shape
    inter = two_i // 2
    ids = ids.to(torch.int32).contiguous()
    route = weights.to(torch.float32).contiguous()
    h = torch.empty(T * top_k, inter, dtype=x.dtype, device=x.device)
    out = torch.empty_like(x)
    launch = pdl.options(x.device)
    bn, bk, warps = config(H, glu=True)
    gate_up_kernel[(T * top_k, -(-inter // bn))](x, gate_up, ids, h, top_k, inter, gate_up.stride(0), K=H,
                                                  BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, **launch)
    bn, bk, warps = config(inter)
    down_kernel[(T, -(-H // bn))](h, down, ids, route, out, H, down.stride(0), K=inter, TOP_K=top_k,
                                  K_PAD=k_pad(top_k), BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, **launch)
    return out
