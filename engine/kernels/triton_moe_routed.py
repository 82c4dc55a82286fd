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
How a kernel splits its work is a RoutedTiles: rows a program, K words a load, warps, and two ways to put more loads
in flight at once (the gate's and the up's rows in one tile; 2 or 4 of a token's pairs in one tile of the weighted
sum, still added in top-k order). At route 2's shapes the reference tiling (DEFAULT_TILES) read its experts at
~0.1-0.3 of the copy rate at 1 token: few programs, each waiting on small loads. benchmarks/gpu_moe_routed.py times a
grid of tilings, from which each fused kernel's tiling per format was chosen (DEFAULT_KERNEL_TILES);
ONECAT_MOE_ROUTED_GLU_TILES / ONECAT_MOE_ROUTED_DOWN_TILES launch the fused kernels with another for a route's A/B.
A tiling is fixed per kernel and format, never per step, so a pair's result never depends on the step it is in.
"""
from __future__ import annotations

import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from onecat.engine.kernels.triton_fp4 import X_PRESCALE, block_scale, e2m1_times_2m126
from onecat.engine.kernels.triton_w4a16 import MAGIC, _words_per_tile, tile

W4A16 = 2  # FMT of routed_gemv_kernel besides triton_fp4.NVFP4 / MXFP4 (0, 1)
FORMATS = {"nvfp4": 0, "mxfp4": 1, "int4": W4A16}  # the words' format name (PackedExperts.routed) -> FMT
# a fused kernel's tiling for a whole route's A/B: "block_n=16,max_words=128,warps=4,glu_together=1,pairs=2"
TILES_ENV = {"glu": "ONECAT_MOE_ROUTED_GLU_TILES", "down_sum": "ONECAT_MOE_ROUTED_DOWN_TILES"}


class RoutedTiles(NamedTuple):
    """How routed_gemv_kernel splits its work. A pair's result depends on these and on its own row and expert alone
    (never on the other pairs of a step), so they are chosen per weight shape, never per step."""

    block_n: int = 16  # output rows a program
    max_words: int = 64  # K words a tile row loads per iteration, at most
    warps: int = 2
    glu_together: bool = False  # gate/up: the gate's and the up's rows in one tile, one K loop
    pairs: int = 1  # the weighted down sum: 1, 2 or 4 of a token's pairs in one tile (their loads in flight at once)


DEFAULT_TILES = RoutedTiles()  # the separate per-pair GEMVs' tiling, and the reference the tiling sweep compares with
# per fused kernel (routed_glu, routed_down_sum) and format (FMT): the tiling it launches with unless its TILES_ENV
# names another. Chosen on an H100 from route 2's experts (benchmarks/results/gpu_moe_routed_{nvfp4,w4a16}_h100.json):
# the fastest at 1 token among the tilings no more than 3% slower than DEFAULT_TILES at 5 and 40 tokens (a verify
# step's and batch 8's). NVFP4 gate/up 14.2 -> 11.4 us at 1 token (0.91x / 0.94x of the reference's time at 5 / 40),
# down 13.3 -> 11.2 us (0.92x / 0.94x); W4A16 gate/up 9.7 -> 6.8 us (0.88x / 1.03x); W4A16's down keeps the reference
# (every faster one at 1 token was 9-58% slower at 5 or 40). MXFP4 (not timed) takes NVFP4's: the same decode but
# for the scales' block.
GLU_TILES = RoutedTiles(block_n=8, max_words=128, warps=2, glu_together=True)  # both formats' fastest so chosen
FP4_DOWN_TILES = RoutedTiles(block_n=8, max_words=128, warps=1, pairs=2)
DEFAULT_KERNEL_TILES = {"glu": dict.fromkeys(FORMATS.values(), GLU_TILES),
                        "down_sum": {FORMATS["nvfp4"]: FP4_DOWN_TILES, FORMATS["mxfp4"]: FP4_DOWN_TILES,
                                     W4A16: DEFAULT_TILES}}


def parse_tiles(text: str, env: str = "ONECAT_MOE_ROUTED_*_TILES") -> RoutedTiles:
    """RoutedTiles from "block_n=16,max_words=128,warps=4,glu_together=1,pairs=2" (fields left out: defaults)."""
    fields, values = RoutedTiles._fields, {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, value = item.partition("=")
        name = name.strip()
        if name not in fields or not value.strip().isdigit():
            raise ValueError(f"{env}: {item!r} is not NAME=INTEGER with NAME one of {', '.join(fields)} "
                             f"(e.g. {env}=block_n=16,max_words=128,warps=4,glu_together=1,pairs=2)")
        values[name] = int(value) if name != "glu_together" else value.strip() == "1"
    t = RoutedTiles(**values)
    if t.pairs not in (1, 2, 4) or t.block_n & (t.block_n - 1) or t.max_words & (t.max_words - 1) \
            or t.warps & (t.warps - 1):
        raise ValueError(f"{env}={text!r}: pairs must be 1, 2 or 4 and block_n, max_words, warps powers of two")
    return t


def _tiles_from_env(kernel: str) -> dict[int, RoutedTiles]:
    """Per format, the kernel's tiling: its TILES_ENV's for every format where set, else DEFAULT_KERNEL_TILES'."""
    text = os.environ.get(TILES_ENV[kernel], "").strip()
    if not text:
        return dict(DEFAULT_KERNEL_TILES[kernel])
    return dict.fromkeys(DEFAULT_KERNEL_TILES[kernel], parse_tiles(text, TILES_ENV[kernel]))


TILES_IN_USE = {kernel: _tiles_from_env(kernel) for kernel in TILES_ENV}  # kernel -> FMT -> tiling; read at import


@triton.jit
def fp4_row_sums(x_rows, q_ptr, s_ptr, g_ptr, wrows, R: tl.constexpr, K: tl.constexpr, FMT: tl.constexpr,
                 BLOCK_KW: tl.constexpr):
    """float32 [R] products of activation rows (x_rows: [R, 1] pointers) with weight rows `wrows` [R, 1] of an
    expert stack (expert * rows an expert + row: q_ptr, s_ptr its words and block scales, g_ptr its NVFP4 global
    scales)."""
    B: tl.constexpr = 16 if FMT == 0 else 32
    GW: tl.constexpr = B // 8  # words per block
    KW: tl.constexpr = K // 8
    NB: tl.constexpr = K // B
    gscale = tl.load(g_ptr + wrows) if FMT == 0 else 1.0
    c = tl.arange(0, BLOCK_KW)[None, :]
    acc = tl.zeros([R, BLOCK_KW], tl.float32)
    for k0 in tl.range(0, KW, BLOCK_KW):
        cols = k0 + c
        w = tl.load(q_ptr + wrows * KW + cols).to(tl.uint32, bitcast=True)
        s = block_scale(tl.load(s_ptr + wrows * NB + cols // GW), gscale, FMT)
        xo = (cols // GW) * B + cols % GW + (wrows * 0).to(tl.int32)
        t = e2m1_times_2m126(w, 0) * (tl.load(x_rows + xo).to(tl.float32) * X_PRESCALE)
        for j in tl.static_range(1, 8):
            t += e2m1_times_2m126(w, j) * (tl.load(x_rows + xo + j * GW).to(tl.float32) * X_PRESCALE)
        acc += t * s
    return tl.sum(acc, axis=1)


@triton.jit
def w4a16_row_sums(x_rows, q_ptr, sz_ptr, wrows, magic, R: tl.constexpr, K: tl.constexpr, G: tl.constexpr,
                   BLOCK_KW: tl.constexpr):
    """fp4_row_sums for a W4A16 stack (sz_ptr at its (scale, zero) pairs)."""
    c = tl.arange(0, BLOCK_KW)[None, :]
    acc = tl.zeros([R, BLOCK_KW], tl.float32)
    for k0 in tl.range(0, K // 8, BLOCK_KW):  # the one-row tile of the W4A16 GEMV (its other accumulators unused)
        acc, _, _, _, _, _, _, _ = tile(x_rows, q_ptr, sz_ptr, wrows, c, k0, magic, acc, acc, acc, acc, acc, acc, acc,
                                        acc, K, G, 1)
    return tl.sum(acc, axis=1)


@triton.jit
def row_sums(x_rows, q_ptr, s_ptr, g_ptr, wrows, magic, R: tl.constexpr, K: tl.constexpr, FMT: tl.constexpr,
             G: tl.constexpr, BLOCK_KW: tl.constexpr):
    """float32 [R]: activation row i (x_rows [R] pointers) times stack row wrows[i] (int64 [R]): FP4 (FMT 0, 1;
    s_ptr its block scales, g_ptr its global scales) or W4A16 (FMT 2; s_ptr its (scale, zero) pairs). Every row's
    products and sums are its own: which rows share the tile does not change them."""
    if FMT == 2:
        return w4a16_row_sums(x_rows[:, None], q_ptr, s_ptr, wrows[:, None], magic, R, K, G, BLOCK_KW)
    else:
        return fp4_row_sums(x_rows[:, None], q_ptr, s_ptr, g_ptr, wrows[:, None], R, K, FMT, BLOCK_KW)


@triton.jit
def halves(v, N: tl.constexpr):
    """[2 N] -> ([N], [N]): its first and second halves."""
    return tl.split(tl.permute(tl.reshape(v, [2, N]), (1, 0)))


@triton.jit
def add_in_order(total, v, PAIRS: tl.constexpr, N: tl.constexpr):
    """total + v[0:N] + v[N:2N] + ... (PAIRS parts of N, 1, 2 or 4), added one part after the other in that order."""
    if PAIRS == 1:
        return total + v
    elif PAIRS == 2:
        a, b = halves(v, N)
        return (total + a) + b
    else:
        first, second = halves(v, 2 * N)  # parts 0, 1 and parts 2, 3
        p0, p1 = halves(first, N)
        p2, p3 = halves(second, N)
        return (((total + p0) + p1) + p2) + p3


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
                       SUM_TOPK: tl.constexpr = False, SHARED: tl.constexpr = False,
                       GLU_TOGETHER: tl.constexpr = False, PAIRS: tl.constexpr = 1):
    """Program (row tile, pair): y[pair, rows] of the pair's row and expert (row_sums' formats). GLU: the expert's
    weight is [gate | up] (2N rows) and y[pair, rows] = SiLU(gate) * up, each product rounded to y's dtype first
    and the SiLU * mul as triton_fused.silu_mul computes it; GLU_TOGETHER: the gate's and up's rows in one tile
    (one K loop, both loads in flight at once). SUM_TOPK (one row per pair): program (row tile, token) writes
    y[token, rows] = the sum over the token's TOP_K pairs, in order, of each pair's product (rounded to y's dtype)
    times its router weight w_ptr[pair], in float32, rounded once: the layer's weighted sum, in this kernel; PAIRS
    of them share a tile (their loads in flight at once; still added in order); SHARED adds the gated shared
    expert, sigmoid(sg_ptr[token]) * sh_ptr[token, rows] (shared_epilogue)."""
    expert_rows = 2 * N if GLU else N
    dt = y_ptr.dtype.element_ty
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    rows = tl.where(row_ok, rows, 0).to(tl.int64)  # out-of-range rows re-read row 0, not stored
    if SUM_TOPK:
        token = tl.program_id(1).to(tl.int64)
        total = tl.zeros([BLOCK_N], tl.float32)
        part = tl.arange(0, PAIRS * BLOCK_N) // BLOCK_N  # a tile row's pair among the PAIRS
        tiled = tl.reshape(tl.zeros([PAIRS, BLOCK_N], tl.int64) + rows[None, :], [PAIRS * BLOCK_N])  # pair-major
        for j in tl.range(0, TOP_K, PAIRS):  # a loop, not unrolled: the V100 build of 8 unrolled pairs spilled
            pair = token * TOP_K + j + part
            expert = tl.load(ids_ptr + pair).to(tl.int64)
            sums = row_sums(x_ptr + pair * K, q_ptr, s_ptr, g_ptr, expert * expert_rows + tiled, magic,
                            PAIRS * BLOCK_N, K, FMT, G, BLOCK_KW)
            total = add_in_order(total, sums.to(dt).to(tl.float32) * tl.load(w_ptr + pair).to(tl.float32),
                                 PAIRS, BLOCK_N)
        out = total.to(dt)
        if SHARED:
            out = shared_epilogue(out, sh_ptr + token * N + rows, sg_ptr + token)
        tl.store(y_ptr + token * N + rows, out, mask=row_ok)
    else:
        pair = tl.program_id(1).to(tl.int64)
        expert = tl.load(ids_ptr + pair).to(tl.int64)
        x_row = x_ptr + (pair if PER_PAIR else pair // TOP_K) * K
        if GLU and GLU_TOGETHER:
            both = tl.reshape(tl.join(rows, rows + N), [2 * BLOCK_N])  # interleaved: gate row, its up row, ...
            sums = row_sums(x_row + both * 0, q_ptr, s_ptr, g_ptr, expert * expert_rows + both, magic, 2 * BLOCK_N,
                            K, FMT, G, BLOCK_KW)
            gate, up = tl.split(tl.reshape(sums, [BLOCK_N, 2]))
            gate = gate.to(dt).to(tl.float32)
            out = (gate / (1.0 + tl.exp(-gate))).to(dt) * up.to(dt)
        else:
            out = row_sums(x_row + rows * 0, q_ptr, s_ptr, g_ptr, expert * expert_rows + rows, magic, BLOCK_N, K, FMT,
                           G, BLOCK_KW)
            if GLU:
                gate = out.to(dt).to(tl.float32)
                up = row_sums(x_row + rows * 0, q_ptr, s_ptr, g_ptr, expert * expert_rows + rows + N, magic, BLOCK_N,
                              K, FMT, G, BLOCK_KW).to(dt)
                out = (gate / (1.0 + tl.exp(-gate))).to(dt) * up
        tl.store(y_ptr + pair * N + rows, out.to(dt), mask=row_ok)


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
            weights: torch.Tensor | None = None, shared: tuple[torch.Tensor, torch.Tensor] | None = None,
            tiles: RoutedTiles | None = None):
    """routed_gemv_kernel over every pair (or, with `weights`, every token's pairs summed), tiled by `tiles`
    (default: the fused kernels' TILES_IN_USE for the format; the separate per-pair GEMVs DEFAULT_TILES)."""
    experts, n, kw = qweight.shape
    pairs = ids.numel()
    n_out = n // 2 if glu else n
    programs = pairs // top_k if weights is not None else pairs
    y = torch.empty(programs, n_out, dtype=x.dtype, device=x.device)
    sg, sh = (shared[0].contiguous(), shared[1].contiguous()) if shared is not None else (ids, ids)
    t = tiles or (TILES_IN_USE["glu"][fmt] if glu else TILES_IN_USE["down_sum"][fmt] if weights is not None
                  else DEFAULT_TILES)
    routed_gemv_kernel[(triton.cdiv(n_out, t.block_n), programs)](
        x, qweight, scales, second, ids, ids if weights is None else weights, sh, sg, y, n_out, MAGIC, TOP_K=top_k,
        PER_PAIR=per_pair, **launch_constants(t, fmt, kw, top_k, glu, sum_topk=weights is not None), G=group, GLU=glu,
        SUM_TOPK=weights is not None, SHARED=shared is not None, num_warps=t.warps)
    return y


def launch_constants(t: RoutedTiles, fmt: int, kw: int, top_k: int, glu: bool, sum_topk: bool) -> dict:
    """The kernel's tile constants for `t` on rows of kw words: K, FMT, BLOCK_N, BLOCK_KW (the largest power of two
    <= t.max_words dividing kw; W4A16 at least 8), GLU_TOGETHER (gate/up only) and PAIRS (the weighted sum only, 1
    unless it divides top_k): a tiling's fields that a launch does not use leave its kernel as it is."""
    block_kw = _words_per_tile(kw, t.max_words)
    return {"K": kw * 8, "FMT": fmt, "BLOCK_N": t.block_n,
            "BLOCK_KW": max(8, block_kw) if fmt == W4A16 else block_kw, "GLU_TOGETHER": t.glu_together and glu,
            "PAIRS": t.pairs if sum_topk and top_k % t.pairs == 0 else 1}
