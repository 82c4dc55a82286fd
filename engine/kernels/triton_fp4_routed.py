"""The FP4 GEMV of MoE experts picked on the device (CUDA, Triton): NVFP4 / MXFP4 experts stacked [E, N, K/8]
(engine/quant/fp4/layout.py per expert), each (token, expert) pair of a step multiplied by its expert, the
expert read from the router's ids in device memory. No host read of the routing, so a CUDA graph captures
it (engine/layers/moe.py PackedExperts).

One program per (tile of output rows, pair); the codes and block scales are decoded as the FP4 GEMV decodes
them (triton_fp4.py: exact products in float32, fp32 sums, one rounding of the output), so a pair's result
depends on its own row and expert alone, whatever else the step holds.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from onecat.engine.kernels.triton_fp4 import X_PRESCALE, block_scale, e2m1_times_2m126


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


def routed_gemv(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, gscale: torch.Tensor, fmt: int,
                ids: torch.Tensor, top_k: int, per_pair: bool) -> torch.Tensor:
    """y [P, N]: pair p = (token p // top_k, expert ids[p]) of `ids` [P] (the router's [T, top_k] flattened)
    times its expert's weight; x [T, K] (or [P, K], one row per pair, when `per_pair`), contiguous fp16/bf16;
    qweight int32 [E, N, K/8], scales uint8 [E, N, K/B], gscale float32 [E, N] (NVFP4; any tensor for MXFP4)."""
    experts, n, kw = qweight.shape
    pairs = ids.numel()
    y = torch.empty(pairs, n, dtype=x.dtype, device=x.device)
    block_kw = 64  # whole blocks of words (K is a multiple of the block), dividing the row
    while kw % block_kw:
        block_kw //= 2
    fp4_routed_gemv_kernel[(triton.cdiv(n, 16), pairs)](
        x, qweight, scales, gscale, ids, y, n, TOP_K=top_k, PER_PAIR=per_pair, K=kw * 8, FMT=fmt, BLOCK_N=16,
        BLOCK_KW=block_kw, num_warps=2)
    return y
