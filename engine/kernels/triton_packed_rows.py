"""Packed weights (NVFP4, MXFP4, W4A16, FP8) times 17-128 activation rows, read packed: a speculative verify step at
batch > 1, a decode step of 17-128 sequences.

Up to 16 rows the packed GEMV takes a call (engine/kernels/quant_gemv.py, 8 rows a launch); past that the layer used
to dequantize its whole weight into the activation dtype on every call and run the library GEMM: the packed words
read, a dense copy written and read again, ~4.6 bytes moved per weight where the packed weight is ~0.56, and with
the words in the tensor-core GEMV's tiles an un-tiling copy first. A verify step of 8 requests of 1 + k rows each,
or a decode step of 32 sequences, is such a call on every projection.

Here a program owns BLOCK_N output rows and all (up to BLOCK_M) activation rows: each step decodes one run of 128
input columns of its weight rows from the words as they lie (row-major or in mma tiles; FP4 codes in fp4.layout's
places or in an activation dtype's code slots; W4A16 nibbles in w4a16.layout's interleave; FP8 bytes in
fp8.layout's), scales each code in float32 as the formats' dequantizers do and rounds it once to the activation
dtype (so the tile holds exactly what triton_fp4.dequantize / triton_w4a16.w4a16_dequant / triton_fp8.dequantize
would write), and multiplies it against the activation rows on the tensor cores (fp32 accumulation). The weight is
read once for all rows; a code's columns need not be contiguous: the decoded tile is permuted into column order (in
registers), so the activations load as contiguous runs. A row's result may depend on how many rows share the call
(the dot's instruction shape), as the library GEMM's does: the verifier's exactness does not rest on it (a plain
step and a verify row run different kernels already).

Checked under Triton's interpreter (tests/test_packed_rows_interpret.py) and built offline for sm_90 at every
default config (engine/kernel_tools/triton_sm90.py: 133-255 registers, no spills, at most 88 KB of shared memory;
the first build found two errors the interpreter runs past). tests/test_packed_rows_gpu.py passed on an H100, and
`scripts/gpu_bench.sh OUT packed_rows` timed it there against the dequantizing path and the 8-row GEMV launches:
the rows each format sends it come from that timing (triton_support.PACKED_ROWS_UP_TO, quant_gemv.blocked_rows).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from onecat.engine.kernels.triton_fp4 import block_scale, code_bits, code_places

RUN = 128  # input columns a step: one run of the words' tiles (16 words of 8 codes)
NVFP4, MXFP4, W4A16, FP8 = 0, 1, 2, 3  # FMT (triton_fp4.NVFP4 / MXFP4); the kernel compares the numbers (no globals)


@triton.jit(do_not_specialize=["M"])  # one build for every row count of a tile size (triton_builds.py says why)
def packed_rows_kernel(x_ptr, q_ptr, s_ptr, g_ptr, y_ptr, N, M, order_ptr, sched_ptr, K: tl.constexpr,
                       FMT: tl.constexpr, G: tl.constexpr, TILED: tl.constexpr, SLOTS: tl.constexpr, M0: tl.constexpr,
                       M1: tl.constexpr, M2: tl.constexpr, M3: tl.constexpr, S0: tl.constexpr, S1: tl.constexpr,
                       S2: tl.constexpr, S3: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
                       STAGES: tl.constexpr, SPLIT: tl.constexpr, GROUPED: tl.constexpr = False,
                       X_DIV: tl.constexpr = 1, SZ_PAIRS: tl.constexpr = False):
    """y[:M, n0:n0 + BLOCK_N] of x [M, K] and the packed weight. Word i (0-15) of a run holds 8 codes, here
    decoded along a last axis c (0-7) and then permuted into column order, so the activations load as contiguous
    runs: fp4.layout's places and w4a16.layout's nibbles put code c at column blk * B + c * GW + i % GW of block
    (group) blk = i // GW; code slots put slot c // 2's first (c even) or second code at column 8 i + c (MXFP4:
    fp4.slots.MXFP4_ORDER within each 32); FP8 words (32 a run) hold 4 bytes, byte c of word i at column
    16 (i // 4) + 4 c + i % 4 (fp8.layout). M*/S*: the slots' first-code magnitude and sign bits (SlotLayout).
    s_ptr: FP4 block-scale bytes [N, K/B], W4A16 scales [N, K/G] or FP8 row scales [N]; g_ptr: NVFP4's global
    scale [N] or W4A16's zeros [N, K/G]. SPLIT > 1: program (i, s) sums the s-th of SPLIT
    equal runs of K into float32 partials y_ptr[s] ([SPLIT, M, N]), which the caller adds in split order.
    GROUPED (a MoE layer's experts stacked [E, N, K/8], row-major, SPLIT 1): program (i, b) runs block b of
    grouped_schedule's `sched_ptr` ([3, blocks]: expert, first sorted pair, pairs; expert -1: no block): the sorted
    pairs order_ptr[first ..] times that expert's weight, x row pair // X_DIV, y row pair. SZ_PAIRS: W4A16's
    scales and zeros interleaved in s_ptr ((scale, zero) a group, the routed stacks' layout)."""
    CPW: tl.constexpr = 4 if FMT == 3 else 8  # codes a word
    WPR: tl.constexpr = 128 // CPW  # words a run
    B: tl.constexpr = 16 if FMT == 0 or FMT == 3 else (32 if FMT == 1 else G)
    GW: tl.constexpr = B // CPW  # words of a block
    KW: tl.constexpr = K // CPW
    NB: tl.constexpr = K // B  # blocks (groups) of a row
    RUNS: tl.constexpr = K // 128
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    rows = tl.where(row_ok, rows, 0).to(tl.int64)
    m = tl.arange(0, BLOCK_M)
    if GROUPED:
        blocks = tl.num_programs(1)
        b = tl.program_id(1)
        expert = tl.load(sched_ptr + b)
        if expert < 0:
            return
        first = tl.load(sched_ptr + blocks + b)
        m_ok = m < tl.load(sched_ptr + 2 * blocks + b)
        pair = tl.load(order_ptr + first + m, mask=m_ok, other=0).to(tl.int64)
        x_row = pair // X_DIV
        r2 = expert.to(tl.int64) * N + rows[:, None]  # the expert's rows of the stack
    else:
        m_ok = m < M
        x_row = m
        r2 = rows[:, None]
    wi = tl.arange(0, WPR)[None, :]  # word of the run
    if TILED:  # quant_gemv.mma_tiles: the 16 rows of a tile own one contiguous block of 16 x WPR words a run
        word_at = ((r2 // 16) * RUNS * 16 * WPR) + (r2 % 16) * WPR + wi
        run_step = 16 * WPR
    else:
        word_at = r2 * KW + wi
        run_step = WPR
    c = tl.arange(0, CPW)[None, None, :]
    if SLOTS:
        s = c // 2
        half = (c % 2) * 16
        m_at = (tl.where(s == 0, M0, tl.where(s == 1, M1, tl.where(s == 2, M2, M3))) + half) % 32
        s_at = (tl.where(s == 0, S0, tl.where(s == 1, S1, tl.where(s == 2, S2, S3))) + half) % 32
        m_at = m_at.to(tl.uint32)
        s_at = s_at.to(tl.uint32)
    elif FMT < 2:  # fp4.layout.SLOTS: code c's bits come by one or two rotate-and-mask (triton_fp4.code_places)
        r1, k1, r2c, k2 = code_places(c)
    x_at = x_row[:, None] * K + tl.arange(0, 128)[None, :]  # a run's activations, contiguous (the tile is reordered)
    gscale = tl.load(g_ptr + r2) if FMT == 0 else 1.0
    row_scale = tl.load(s_ptr + r2) if FMT == 3 else 1.0  # FP8: the row's scale
    dt = x_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    if GROUPED:  # axis 1 is the block; K is not split
        run0 = 0
    else:
        run0 = tl.program_id(1) * (RUNS // SPLIT)
    for step in tl.range(run0, run0 + RUNS // SPLIT, num_stages=STAGES):
        words = tl.load(q_ptr + word_at + step * run_step, mask=row_ok[:, None], other=0)
        w3 = words.to(tl.uint32, bitcast=True)[:, :, None]  # [BLOCK_N, WPR, 1]
        block_at = r2 * NB + step * (128 // B) + wi // GW  # each word's block (group)
        if FMT == 3:  # the byte's sign to bit 31, exponent and mantissa to bits 20-26: e4m3 * 2^-120, exact
            b = (w3 >> (8 * c).to(tl.uint32)) & 0xFF
            value = (((b & 0x80) << 24) | ((b & 0x7F) << 20)).to(tl.float32, bitcast=True) * (2.0 ** 120)
            scale = tl.broadcast_to(row_scale, [BLOCK_N, WPR])
        elif FMT == 2:  # (q - z) * s in float32, as w4a16_dequant forms it
            if SZ_PAIRS:
                scale = tl.load(s_ptr + 2 * block_at, mask=row_ok[:, None], other=0.0).to(tl.float32)
                zero = tl.load(s_ptr + 2 * block_at + 1, mask=row_ok[:, None], other=0.0).to(tl.float32) + 8388608.0
            else:
                scale = tl.load(s_ptr + block_at, mask=row_ok[:, None], other=0.0).to(tl.float32)
                zero = tl.load(g_ptr + block_at, mask=row_ok[:, None], other=0.0).to(tl.float32) + 8388608.0
            q = ((w3 >> (4 * c).to(tl.uint32)) & 0xF) | 0x4B000000  # the float 2^23 + q
            value = q.to(tl.float32, bitcast=True) - zero[:, :, None]
        else:
            sb = tl.load(s_ptr + block_at, mask=row_ok[:, None], other=0)
            scale = block_scale(sb, gscale, FMT) * (2.0 ** -26)  # exact: the block's scale
            if FMT == 1:
                scale = tl.where(sb.to(tl.uint32) == 255, float("nan"), scale)  # E8M0 255 is NaN
            if SLOTS:
                magnitude = (w3 >> m_at) & 7
                sign = (w3 >> s_at) & 1
                bits = (sign << 31) | (magnitude << 22)
            else:
                bits = code_bits(w3, r1, k1, r2c, k2)
            value = bits.to(tl.float32, bitcast=True) * (2.0 ** 126)  # exact: the code's e2m1 value
        wv = (value * scale[:, :, None]).to(dt)  # [BLOCK_N, word i, code c]: put in column order
        if SLOTS and FMT == 0:  # column 8 i + c already
            w_tile = tl.reshape(wv, [BLOCK_N, 128])
        elif SLOTS:  # MXFP4_ORDER: word i = 4 g + 2 a + b, code c = 2 s + h is column 32 g + 16 b + 4 s + 2 a + h
            w_tile = tl.reshape(tl.permute(tl.reshape(wv, [BLOCK_N, 4, 2, 2, 4, 2]), (0, 1, 3, 4, 2, 5)),
                                [BLOCK_N, 128])
        else:  # word i = GW blk + w, code c is column B blk + GW c + w
            w_tile = tl.reshape(tl.permute(tl.reshape(wv, [BLOCK_N, 128 // B, GW, CPW]), (0, 1, 3, 2)),
                                [BLOCK_N, 128])
        x_tile = tl.load(x_ptr + x_at + step * 128, mask=m_ok[:, None], other=0.0)
        acc = tl.dot(x_tile, tl.trans(w_tile), acc)
    if GROUPED:
        out = y_ptr + pair[:, None] * N + rows[None, :]
    else:
        out = y_ptr + tl.program_id(1).to(tl.int64) * M * N + m.to(tl.int64)[:, None] * N + rows[None, :]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & row_ok[None, :])


def config(rows: int, n: int, k: int, fmt: int | None = None) -> tuple[int, int, int, int, int]:
    """(BLOCK_N, BLOCK_M, num_warps, stages, SPLIT) for `rows` activation rows and an [n, k] weight of format `fmt`:
    every row in one tile (the weight read once), 64 weight rows a program, two stages (86 KB of shared memory at
    128 rows, inside SM86/89's 99 KB), 4 warps, but 8 for NVFP4 past 64 rows (its tiles spill ~550 B a thread with 4
    in the sm_90 build, `onecat kernels check --arch sm_90`; with 8 they do not). K is split (split K adds no
    activation reads): up to 64 rows until the grid has about two programs per SM of an H100; past 64, where a
    program's tile is four times the work, until no program runs more than 8192 columns of K and, with 4 warps,
    the grid has about one program a SM. Swept on an H100 over the Qwen3.5-27B projections, NVFP4 and W4A16 at 32
    and 128 rows (benchmarks/results/gpu_packed_rows_16_{nvfp4,w4a16}_h100.json): at 128 rows W4A16's choice is the
    fastest of the 12 configs on all five, 18-67% under the earlier choice (8 warps, K split for two programs a
    SM); NVFP4's the fastest of the 8-warp ones on all five (within 0-16% of the spilling 4-warp ones)."""
    block_n, warps = 64, (8 if rows > 64 and fmt == NVFP4 else 4)
    runs, split, programs = k // RUN, 1, -(-n // block_n)
    if rows <= 64:
        more = lambda s: programs * s < 256  # noqa: E731
    else:
        more = lambda s: k // s > 8192 or (warps == 4 and programs * s < 128)  # noqa: E731
    while more(split) and split < 8 and runs % (2 * split) == 0:
        split *= 2
    return block_n, max(16, triton.next_power_of_2(rows)), warps, 2, split


def slot_constants(slots: torch.dtype | None) -> dict:
    """The kernel's M0-M3 / S0-S3: where the code slots of dtype `slots` hold each code's magnitude and sign bits
    (read only with SLOTS; any layout's values otherwise)."""
    from onecat.engine.kernels.fp4_slot_bits import SLOTS

    layout = SLOTS[slots if slots is not None else torch.float16]
    return {**{f"M{s}": layout.magnitude_at(s, 0) for s in range(4)},
            **{f"S{s}": layout.sign_at(s, 0) for s in range(4)}}


def _launch(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, second: torch.Tensor, fmt: int, group: int,
            tiled: int, slots: torch.dtype | None, cfg: tuple[int, int, int, int, int] | None) -> torch.Tensor:
    n, kw = qweight.shape
    k = kw * (4 if fmt == FP8 else 8)
    rows = x.numel() // k
    x2 = x.reshape(rows, k).contiguous()
    block_n, block_m, warps, stages, split = cfg or config(rows, n, k, fmt)
    y = torch.empty(split, rows, n, dtype=x.dtype if split == 1 else torch.float32, device=x.device)
    packed_rows_kernel[(-(-n // block_n), split)](
        x2, qweight, scales, second, y, n, rows, y, y,  # order_ptr, sched_ptr: read only when GROUPED
        K=k, FMT=fmt, G=group, TILED=bool(tiled), SLOTS=slots is not None, **slot_constants(slots),
        BLOCK_N=block_n, BLOCK_M=block_m, STAGES=stages, SPLIT=split, num_warps=warps)
    out = y[0] if split == 1 else y.sum(0).to(x.dtype)  # partials added in split order, rounded once
    return out.view(*x.shape[:-1], n)


def fp4_rows_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, gscale: torch.Tensor, fmt: int,
                  tiled: int = 0, slots: torch.dtype | None = None,
                  cfg: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """y = x @ dequant(W)^T for x [..., K] of 17-128 rows (fp16/bf16, CUDA or the Triton interpreter) and an FP4
    W's words as the layer keeps them: `tiled` (quant_gemv.mma_tiles) or row-major, their codes in fp4.layout's
    places or in the code slots of the dtype `slots`. fmt: NVFP4 / MXFP4; gscale: float32 [N] (NVFP4).
    cfg: config()'s tuple, for a tile sweep (benchmarks/gpu_packed_rows.py --sweep)."""
    return _launch(x, qweight, scales, gscale, fmt, 16 if fmt == NVFP4 else 32, tiled, slots, cfg)


def w4a16_rows_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int,
                    tiled: int = 0, cfg: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """fp4_rows_gemm for a W4A16 weight (w4a16.layout: groups of 32, 64 or 128, scales and zeros [N, K/group];
    the input already permuted where the layer has act-order)."""
    return _launch(x, qweight, scales, zeros, W4A16, group, tiled, None, cfg)


def fp8_rows_gemm(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, tiled: int = 0,
                  cfg: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """fp4_rows_gemm for an FP8 (E4M3) weight (fp8.layout: words [N, K/4], a float32 scale per row)."""
    return _launch(x, qweight, scale, scale, FP8, 16, tiled, None, cfg)
