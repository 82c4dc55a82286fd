"""GEMVs of packed MoE experts picked on the device (CUDA, Triton): experts stacked [E, N, K/8] (NVFP4 / MXFP4,
engine/quant/fp4/layout.py, or W4A16, engine/quant/w4a16/layout.py, per expert), each (token, expert) pair of a
step multiplied by its expert, the expert read from the router's ids in device memory. No host read of the
routing, so a CUDA graph captures it (engine/layers/moe.py PackedExperts).

One program per (tile of output rows, pair); the codes and scales are decoded as the formats' one-row GEMVs
decode them (triton_fp4.py, triton_w4a16.py: exact products in float32, fp32 sums, one rounding of the
output), so a pair's result depends on its own row and expert alone, whatever else the step holds.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from onecat.engine.kernels.triton_fp4 import X_PRESCALE, block_scale, e2m1_times_2m126
from onecat.engine.kernels.triton_w4a16 import MAGIC, _words_per_tile, tile


@triton.jit
def fp4_routed_gemv_kernel(x_ptr, q_ptr, s_ptr, g_ptr, ids_ptr, y_ptr, N, TOP_K: tl.constexpr,
                           PER_PAIR: tl.constexpr, K: tl.constexpr, FMT: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_KW: tl.constexpr):
    B: tl.constexpr = 16 if FMT == 0 else 32
    GW: tl.constexpr = B // 8  # words per block
    KW: tl.constexpr = K // 8
    NB: tl.constexpr = K // B
    pair = tl.program_id(1).to(tl.int64)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    x_ptr += (pair if PER_PAIR else pair // TOP_K) * K
    q_ptr += expert * N * KW
    s_ptr += expert * N * NB
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    rows = tl.where(row_ok, rows, 0).to(tl.int64)[:, None]  # out-of-range rows re-read row 0, not stored
    gscale = tl.load(g_ptr + expert * N + rows) if FMT == 0 else 1.0
    c = tl.arange(0, BLOCK_KW)[None, :]
    acc = tl.zeros([BLOCK_N, BLOCK_KW], tl.float32)
    for k0 in tl.range(0, KW, BLOCK_KW):
        cols = k0 + c
        w = tl.load(q_ptr + rows * KW + cols).to(tl.uint32, bitcast=True)
        s = block_scale(tl.load(s_ptr + rows * NB + cols // GW), gscale, FMT)
        xo = (cols // GW) * B + cols % GW + (rows * 0).to(tl.int32)
        t = e2m1_times_2m126(w, 0) * (tl.load(x_ptr + xo).to(tl.float32) * X_PRESCALE)
        for j in tl.static_range(1, 8):
            t += e2m1_times_2m126(w, j) * (tl.load(x_ptr + xo + j * GW).to(tl.float32) * X_PRESCALE)
        acc += t * s
    tl.store(y_ptr + pair * N + rows, tl.sum(acc, axis=1)[:, None].to(y_ptr.dtype.element_ty), mask=row_ok[:, None])


def fp4_routed_gemv(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, gscale: torch.Tensor, fmt: int,
                    ids: torch.Tensor, top_k: int, per_pair: bool) -> torch.Tensor:
    """y [P, N]: pair p = (token p // top_k, expert ids[p]) of `ids` [P] (the router's [T, top_k] flattened)
    times its expert's weight; x [T, K] (or [P, K], one row per pair, when `per_pair`), contiguous fp16/bf16;
    qweight int32 [E, N, K/8], scales uint8 [E, N, K/B], gscale float32 [E, N] (NVFP4; any tensor for MXFP4)."""
    experts, n, kw = qweight.shape
    pairs = ids.numel()
    y = torch.empty(pairs, n, dtype=x.dtype, device=x.device)
    fp4_routed_gemv_kernel[(triton.cdiv(n, 16), pairs)](
        x, qweight, scales, gscale, ids, y, n, TOP_K=top_k, PER_PAIR=per_pair, K=kw * 8, FMT=fmt, BLOCK_N=16,
        BLOCK_KW=_words_per_tile(kw, 64), num_warps=2)
    return y


@triton.jit
def w4a16_routed_gemv_kernel(x_ptr, q_ptr, sz_ptr, ids_ptr, y_ptr, N, magic, TOP_K: tl.constexpr,
                             PER_PAIR: tl.constexpr, K: tl.constexpr, G: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_KW: tl.constexpr):
    pair = tl.program_id(1).to(tl.int64)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    x_ptr += (pair if PER_PAIR else pair // TOP_K) * K
    q_ptr += expert * N * (K // 8)
    sz_ptr += expert * N * (2 * (K // G))
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    rows = tl.where(row_ok, rows, 0).to(tl.int64)[:, None]  # out-of-range rows re-read row 0, not stored
    c = tl.arange(0, BLOCK_KW)[None, :]
    acc = tl.zeros([BLOCK_N, BLOCK_KW], tl.float32)
    for k0 in tl.range(0, K // 8, BLOCK_KW):  # the one-row tile of the W4A16 GEMV (its other accumulators unused)
        acc, _, _, _, _, _, _, _ = tile(x_ptr, q_ptr, sz_ptr, rows, c, k0, magic, acc, acc, acc, acc, acc, acc, acc,
                                        acc, K, G, 1)
    tl.store(y_ptr + pair * N + rows.reshape(BLOCK_N), tl.sum(acc, axis=1).to(y_ptr.dtype.element_ty), mask=row_ok)


def w4a16_routed_gemv(x: torch.Tensor, qweight: torch.Tensor, scale_zero: torch.Tensor, group: int,
                      ids: torch.Tensor, top_k: int, per_pair: bool) -> torch.Tensor:
    """fp4_routed_gemv for W4A16 experts: qweight int32 [E, N, K/8], scale_zero [E, N, 2 K/G]
    (engine/quant/w4a16/layout.py scale_zero_pairs per expert), no act-order permutation."""
    experts, n, kw = qweight.shape
    pairs = ids.numel()
    y = torch.empty(pairs, n, dtype=x.dtype, device=x.device)
    w4a16_routed_gemv_kernel[(triton.cdiv(n, 16), pairs)](
        x, qweight, scale_zero, ids, y, n, MAGIC, TOP_K=top_k, PER_PAIR=per_pair, K=kw * 8, G=group, BLOCK_N=16,
        BLOCK_KW=max(8, _words_per_tile(kw, 64)), num_warps=2)
    return y

