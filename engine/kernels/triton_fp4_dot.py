"""FP4 (NVFP4, MXFP4) at 2-8 rows on SM80 and newer: decode a tile in registers, multiply on the tensor cores.

The FMA FP4 GEMV (triton_fp4.py) spends one FFMA per weight and row, which at 8 rows made it 3x slower
than cuBLAS on fp16 weights (measured on an H200). Here each step decodes 128 input columns of BLOCK_N
rows (the fp4.layout.SLOTS rotations, vectorised over the eight codes of a word) and scales them exactly
in the activation dtype before one tl.dot against the activations padded to 16 rows:
  NVFP4: e2m1 * e4m3 has at most 6 significant bits between 2^-10 and 2688, exact in fp16 and bf16; the
      float32 global scale multiplies the row's sum at the end (the reference rounds e4m3 * global to
      float32 first: a 2^-24 relative difference per block, inside the GEMV's bound);
  MXFP4: e2m1 * 2^(e - e_max) with e_max the largest exponent of the row's blocks in the step: exact while
      a block's exponent is within 23 (fp16; bf16: 126) of e_max, which blocks of one row normally are
      (a smaller block loses its low bits to fp16 underflow); the step's sum is multiplied by 2^(e_max-127).
Products are exact and summed in fp32, so the result keeps the FMA GEMV's bound under those conditions.
SPLIT > 1 splits K over a second grid axis (fp32 partials, summed in a fixed order by the caller).
"""
from __future__ import annotations

import triton
import triton.language as tl

from onecat.engine.kernels.triton_fp4 import code_bits, code_places

MIN_CAPABILITY = 80


@triton.jit(do_not_specialize=["M"])  # one build for every row count (triton_builds.py says why)
def fp4_dot_kernel(x_ptr, q_ptr, s_ptr, g_ptr, y_ptr, N, M, K: tl.constexpr, FMT: tl.constexpr,
                   BLOCK_N: tl.constexpr, SPLIT: tl.constexpr):
    B: tl.constexpr = 16 if FMT == 0 else 32
    GW: tl.constexpr = B // 8
    NBLK: tl.constexpr = 128 // B  # blocks per step: 128 input columns
    KW: tl.constexpr = K // 8
    NB: tl.constexpr = K // B
    STEPS: tl.constexpr = K // 128 // SPLIT
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    rows = tl.where(row_ok, rows, 0).to(tl.int64)
    r3 = rows[:, None, None]
    blk = tl.arange(0, NBLK)[None, :, None]
    wi = tl.arange(0, GW)[None, None, :]
    # per code j (fp4.layout.SLOTS): rotation and mask of its first and second bit group
    r1, m1, r2, m2 = code_places(tl.arange(0, 8)[None, None, :, None])
    xr = tl.arange(0, 16)[None, :]
    xk = tl.arange(0, 128)[:, None]
    x_ok = xr < M
    dt = x_ptr.dtype.element_ty
    s0 = tl.program_id(1) * STEPS
    acc = tl.zeros([BLOCK_N, 16], tl.float32)
    for i in tl.range(0, STEPS):
        step = s0 + i
        words = tl.load(q_ptr + r3 * KW + step * 16 + blk * GW + wi, eviction_policy="evict_first")
        sb = tl.load(s_ptr + rows[:, None] * NB + step * NBLK + tl.arange(0, NBLK)[None, :]).to(tl.uint32)
        w4 = words.to(tl.uint32, bitcast=True)[:, :, None, :]  # [BLOCK_N, NBLK, 1, GW]
        bits = code_bits(w4, r1, m1, r2, m2)
        v = bits.to(tl.float32, bitcast=True) * 8.507059173023462e37  # * 2^126: the E2M1 value, exact
        if FMT == 0:
            s = (((sb & 0x80) << 24) | ((sb & 0x7F) << 20)).to(tl.float32, bitcast=True) * 1.329227995784916e36
            wv = v * s[:, :, None, None]  # e2m1 * e4m3 (the 2^120 above undoes the subnormal encoding)
            step_scale = 1.0
        else:
            e_max = tl.max(sb, axis=1)
            d = tl.maximum(sb.to(tl.int32) - e_max[:, None].to(tl.int32) + 127, 1)
            wv = v * (d << 23).to(tl.float32, bitcast=True)[:, :, None, None]
            step_scale = tl.where(e_max == 0, 5.877471754111438e-39,
                                  (e_max << 23).to(tl.float32, bitcast=True))[:, None]
        a = tl.reshape(wv.to(dt), [BLOCK_N, 128])  # column blk*B + j*GW + w of the step: stored order
        xt = tl.load(x_ptr + xr * K + step * 128 + xk, mask=x_ok, other=0.0)
        acc += tl.dot(a, xt) * step_scale
    if FMT == 0:
        acc = acc * tl.load(g_ptr + rows)[:, None]
    out = y_ptr + tl.program_id(1) * M * N + xr * N + rows[:, None]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & x_ok)


def launch(x, qweight, scales, gscale, out, fmt: int, block_n: int, warps: int, stages: int, split: int) -> None:
    n, kw = qweight.shape
    k = kw * 8
    fp4_dot_kernel[(-(-n // block_n), split)](
        x, qweight, scales, gscale, out, n, x.numel() // k, K=k, FMT=fmt, BLOCK_N=block_n, SPLIT=split,
        num_warps=warps, num_stages=stages)
