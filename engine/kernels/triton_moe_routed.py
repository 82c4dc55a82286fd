"""GEMVs of packed MoE experts picked on the device (CUDA, Triton): experts stacked [E, N, K/8] (NVFP4 / MXFP4,
engine/quant/fp4/layout.py, or W4A16, engine/quant/w4a16/layout.py, per expert), each (token, expert) pair of a
step multiplied by its expert, the expert read from the router's ids in device memory. No host read of the
routing, so a CUDA graph captures it (engine/layers/moe.py PackedExperts).

One program per (tile of output rows, pair); the codes and scales are decoded as the formats' one-row GEMVs
decode them (triton_fp4.py, triton_w4a16.py: exact products in float32, fp32 sums, one rounding of the
output), so a pair's result depends on its own row and expert alone, whatever else the step holds.
routed_glu and routed_down_sum run a layer's experts in two kernels instead of about nine (the gate/up GEMV, SiLU,
mul and copy; the down GEMV, the weighted sum's casts, product, sum and rounding): the gate/up kernel applies the
SiLU * mul to its two rounded products, and the down kernel's program per (row tile, token) adds the token's
pairs in top-k order, and adds a gated shared expert (sigmoid(gate) * output) where the layer has one. Same
roundings as the separate ops (a product rounded to the activation dtype, the SiLU * mul as
triton_fused.silu_mul, the weighted sum in float32 rounded once, the shared expert's three ops each rounded);
PackedExperts takes them unless ONECAT_MOE_FUSED_ROUTED=0 (route 2 on an H100: 1.11x target-only at batch 1,
benchmarks/results/moe_fused_routed_h100.json).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from onecat.engine.kernels.triton_fp4 import X_PRESCALE, block_scale, e2m1_times_2m126
from onecat.engine.kernels.triton_w4a16 import MAGIC, _words_per_tile, tile

W4A16 = 2  # FMT of routed_gemv_kernel besides triton_fp4.NVFP4 / MXFP4 (0, 1)
FORMATS = {"nvfp4": 0, "mxfp4": 1, "int4": W4A16}  # the words' format name (PackedExperts.routed) -> FMT


@triton.jit
def fp4_pair_sums(x_ptr, q_ptr, s_ptr, g_ptr, rows, K: tl.constexpr, FMT: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_KW: tl.constexpr):
    """float32 [BLOCK_N] products of one activation row (x_ptr) with weight rows `rows` [BLOCK_N, 1] of one
    expert (q_ptr, s_ptr at its words and scales; g_ptr at its NVFP4 global scales)."""
    B: tl.constexpr = 16 if FMT == 0 else 32
    GW: tl.constexpr = B // 8  # words per block
    KW: tl.constexpr = K // 8
    NB: tl.constexpr = K // B
    gscale = tl.load(g_ptr + rows) if FMT == 0 else 1.0
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
    return tl.sum(acc, axis=1)


@triton.jit
def w4a16_pair_sums(x_ptr, q_ptr, sz_ptr, rows, magic, K: tl.constexpr, G: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_KW: tl.constexpr):
    """fp4_pair_sums for a W4A16 expert (sz_ptr at its (scale, zero) pairs)."""
    c = tl.arange(0, BLOCK_KW)[None, :]
    acc = tl.zeros([BLOCK_N, BLOCK_KW], tl.float32)
    for k0 in tl.range(0, K // 8, BLOCK_KW):  # the one-row tile of the W4A16 GEMV (its other accumulators unused)
        acc, _, _, _, _, _, _, _ = tile(x_ptr, q_ptr, sz_ptr, rows, c, k0, magic, acc, acc, acc, acc, acc, acc, acc,
                                        acc, K, G, 1)
    return tl.sum(acc, axis=1)


@triton.jit
def pair_sums(x_ptr, q_ptr, s_ptr, g_ptr, expert, expert_rows, rows, magic, K: tl.constexpr, FMT: tl.constexpr,
              G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KW: tl.constexpr):
    """The pair's products with expert `expert` of a stack of `expert_rows` weight rows an expert: FP4 (FMT 0, 1;
    s_ptr its block scales, g_ptr its global scales) or W4A16 (FMT 2; s_ptr its (scale, zero) pairs)."""
    if FMT == 2:
        return w4a16_pair_sums(x_ptr, q_ptr + expert * expert_rows * (K // 8),
                               s_ptr + expert * expert_rows * (2 * (K // G)), rows, magic, K, G, BLOCK_N, BLOCK_KW)
    else:
        return fp4_pair_sums(x_ptr, q_ptr + expert * expert_rows * (K // 8),
                             s_ptr + expert * expert_rows * (K // (16 if FMT == 0 else 32)),
                             g_ptr + expert * expert_rows, rows, K, FMT, BLOCK_N, BLOCK_KW)


@triton.jit
def shared_epilogue(routed, sh_ptr, sg_ptr):
    """routed + sigmoid(gate) * shared, as SparseMoE adds the gated shared expert: the sigmoid rounded to the
    dtype, the product rounded, the sum rounded (torch's bf16 / fp16 ops compute each in float32)."""
    dt = routed.dtype
    g = tl.load(sg_ptr).to(tl.float32)
    gate = (1.0 / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
    shared = tl.load(sh_ptr).to(tl.float32)
    return (routed.to(tl.float32) + (gate * shared).to(dt).to(tl.float32)).to(dt)


@triton.jit
def routed_gemv_kernel(x_ptr, q_ptr, s_ptr, g_ptr, ids_ptr, w_ptr, sh_ptr, sg_ptr, y_ptr, N, magic,
                       TOP_K: tl.constexpr, PER_PAIR: tl.constexpr, K: tl.constexpr, FMT: tl.constexpr,
                       G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KW: tl.constexpr, GLU: tl.constexpr = False,
                       SUM_TOPK: tl.constexpr = False, SHARED: tl.constexpr = False):
    """Program (row tile, pair): y[pair, rows] of the pair's row and expert (pair_sums' formats). GLU: the expert's
    weight is [gate | up] (2N rows) and y[pair, rows] = SiLU(gate) * up, each product rounded to y's dtype first
    and the SiLU * mul as triton_fused.silu_mul computes it. SUM_TOPK (one row per pair): program (row tile, token)
    writes y[token, rows] = the sum over the token's TOP_K pairs, in order, of each pair's product (rounded to y's
    dtype) times its router weight w_ptr[pair], in float32, rounded once: the layer's weighted sum, in this
    kernel; SHARED adds the gated shared expert, sigmoid(sg_ptr[token]) * sh_ptr[token, rows] (shared_epilogue)."""
    expert_rows = 2 * N if GLU else N
    dt = y_ptr.dtype.element_ty
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    rows = tl.where(row_ok, rows, 0).to(tl.int64)[:, None]  # out-of-range rows re-read row 0, not stored
    if SUM_TOPK:
        token = tl.program_id(1).to(tl.int64)
        total = tl.zeros([BLOCK_N], tl.float32)
        for j in tl.range(0, TOP_K):  # a loop, not unrolled: the V100 build of 8 unrolled pairs spilled
            pair = token * TOP_K + j
            expert = tl.load(ids_ptr + pair).to(tl.int64)
            part = pair_sums(x_ptr + pair * K, q_ptr, s_ptr, g_ptr, expert, expert_rows, rows, magic, K, FMT, G,
                             BLOCK_N, BLOCK_KW)
            total += part.to(dt).to(tl.float32) * tl.load(w_ptr + pair).to(tl.float32)
        out = total.to(dt)
        if SHARED:
            out = shared_epilogue(out, sh_ptr + token * N + rows.reshape(BLOCK_N), sg_ptr + token)
        tl.store(y_ptr + token * N + rows.reshape(BLOCK_N), out, mask=row_ok)
    else:
        pair = tl.program_id(1).to(tl.int64)
        expert = tl.load(ids_ptr + pair).to(tl.int64)
        x_ptr += (pair if PER_PAIR else pair // TOP_K) * K
        out = pair_sums(x_ptr, q_ptr, s_ptr, g_ptr, expert, expert_rows, rows, magic, K, FMT, G, BLOCK_N, BLOCK_KW)
        if GLU:
            gate = out.to(dt).to(tl.float32)
            up = pair_sums(x_ptr, q_ptr, s_ptr, g_ptr, expert, expert_rows, rows + N, magic, K, FMT, G, BLOCK_N,
                           BLOCK_KW).to(dt)
            out = (gate / (1.0 + tl.exp(-gate))).to(dt) * up
        tl.store(y_ptr + pair * N + rows.reshape(BLOCK_N), out.to(dt), mask=row_ok)


def fp4_routed_gemv(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, gscale: torch.Tensor, fmt: int,
                    ids: torch.Tensor, top_k: int, per_pair: bool) -> torch.Tensor:
    """y [P, N]: pair p = (token p // top_k, expert ids[p]) of `ids` [P] (the router's [T, top_k] flattened)
    times its expert's weight; x [T, K] (or [P, K], one row per pair, when `per_pair`), contiguous fp16/bf16;
    qweight int32 [E, N, K/8], scales uint8 [E, N, K/B], gscale float32 [E, N] (NVFP4; any tensor for MXFP4)."""
    return _launch(x, qweight, scales, gscale, fmt, 128, ids, top_k, per_pair=per_pair)


def w4a16_routed_gemv(x: torch.Tensor, qweight: torch.Tensor, scale_zero: torch.Tensor, group: int,
                      ids: torch.Tensor, top_k: int, per_pair: bool) -> torch.Tensor:
    """fp4_routed_gemv for W4A16 experts: qweight int32 [E, N, K/8], scale_zero [E, N, 2 K/G]
    (engine/quant/w4a16/layout.py scale_zero_pairs per expert), no act-order permutation."""
    return _launch(x, qweight, scale_zero, scale_zero, W4A16, group, ids, top_k, per_pair=per_pair)


def routed_glu(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, second: torch.Tensor, fmt: str,
               group: int, ids: torch.Tensor, top_k: int) -> torch.Tensor:
    """SiLU(gate) * up [P, N/2] of every pair's [gate | up] expert (qweight [E, N, K/8]) in one kernel: FP4
    (`scales` its block scales, `second` the global scales; fmt "nvfp4" / "mxfp4") or W4A16 (`scales` the
    (scale, zero) pairs, `second` unused, fmt "int4")."""
    return _launch(x, qweight, scales, second, FORMATS[fmt], group, ids, top_k, per_pair=False, glu=True)


def routed_down_sum(h: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, second: torch.Tensor, fmt: str,
                    group: int, ids: torch.Tensor, weights: torch.Tensor, top_k: int,
                    shared: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """[T, N]: each token's router-weighted sum of its pairs' down products (h [P, K], one row per pair), summed in
    float32 in top-k order and rounded once, in one kernel (routed_glu's formats). `shared`: (the shared expert's
    gate logit [T, 1], its output [T, N]) added as sigmoid(gate) * output in the same kernel."""
    return _launch(h, qweight, scales, second, FORMATS[fmt], group, ids, top_k, per_pair=True,
                   weights=weights.reshape(-1).contiguous(), shared=shared)


def _launch(x, qweight, scales, second, fmt: int, group: int, ids, top_k: int, *, per_pair: bool, glu: bool = False,
            weights: torch.Tensor | None = None, shared: tuple[torch.Tensor, torch.Tensor] | None = None):
    """routed_gemv_kernel over every pair (or, with `weights`, every token's pairs summed)."""
    experts, n, kw = qweight.shape
    pairs = ids.numel()
    n_out = n // 2 if glu else n
    programs = pairs // top_k if weights is not None else pairs
    y = torch.empty(programs, n_out, dtype=x.dtype, device=x.device)
    sg, sh = (shared[0].contiguous(), shared[1].contiguous()) if shared is not None else (ids, ids)
    routed_gemv_kernel[(triton.cdiv(n_out, 16), programs)](
        x, qweight, scales, second, ids, ids if weights is None else weights, sh, sg, y, n_out, MAGIC, TOP_K=top_k,
        PER_PAIR=per_pair, K=kw * 8, FMT=fmt, G=group, BLOCK_N=16,
        BLOCK_KW=max(8, _words_per_tile(kw, 64)) if fmt == W4A16 else _words_per_tile(kw, 64),
        GLU=glu, SUM_TOPK=weights is not None, SHARED=shared is not None, num_warps=2)
    return y
