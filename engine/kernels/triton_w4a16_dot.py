"""W4A16 at 2-8 rows on SM80 and newer: dequantize a tile in registers, multiply it on the tensor cores.

The FMA GEMV (triton_w4a16.py) spends one FFMA per weight and row, so at 8 rows it is bound by arithmetic,
2-3x slower than cuBLAS on fp16 weights (measured on an H200). Here each group of G input columns of a
[BLOCK_N, G] weight tile becomes (q - z) in the activation dtype (whole numbers -16..15, exact in fp16 and
bf16: the code ORed into the mantissa of 2^23, minus 2^23 + z in fp32, then converted), is multiplied by the
activations padded to 16 rows with tl.dot (products exact, fp32 sums), and the fp32 group sum is scaled by
the group's scale. So a row's result is held to the same bound as the FMA GEMV's (fp32 sums of exact
products, each group scaled once). SPLIT > 1 splits the groups over a second grid axis (fp32 partials
summed in a fixed order by triton_w4a16's split_sum_kernel). tl.dot needs SM80 (mma.sync m16n8k16 or
wgmma); SM70 keeps the FMA GEMV.
"""
from __future__ import annotations

import triton
import triton.language as tl

MIN_CAPABILITY = 80  # tensor-core tl.dot on 16-bit inputs
ROWS_PAD = 16  # tl.dot's smallest N: activations are padded to 16 rows (masked loads, never stored)
MAGIC = 0x4B000000  # the bits of 2^23 as a float


@triton.jit(do_not_specialize=["M"])  # one build for every row count (triton_builds.py says why)
def w4a16_dot_kernel(x_ptr, q_ptr, sz_ptr, y_ptr, N, M, magic, K: tl.constexpr,
                     G: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr):
    GW: tl.constexpr = G // 8
    KW: tl.constexpr = K // 8
    NG: tl.constexpr = K // G
    GPS: tl.constexpr = NG // SPLIT  # groups per split
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    rows = tl.where(row_ok, rows, 0).to(tl.int64)  # out-of-range rows re-read row 0, not stored
    w = tl.arange(0, GW)
    shifts = 4 * tl.arange(0, 8)
    xr = tl.arange(0, 16)
    xk = tl.arange(0, G)
    x_ok = (xr < M)[None, :]
    dt = x_ptr.dtype.element_ty
    g0 = tl.program_id(1) * GPS
    acc = tl.zeros([BLOCK_N, 16], tl.float32)
    for i in tl.range(0, GPS):
        g = g0 + i
        words = tl.load(q_ptr + rows[:, None] * KW + g * GW + w[None, :], eviction_policy="evict_first")
        s = tl.load(sz_ptr + rows * (2 * NG) + 2 * g).to(tl.float32)
        zc = tl.load(sz_ptr + rows * (2 * NG) + 2 * g + 1).to(tl.float32) + 8388608.0
        codes = ((words[:, None, :] >> shifts[None, :, None]) & 0xF) | magic  # [BLOCK_N, 8, GW]
        d = codes.to(tl.float32, bitcast=True) - zc[:, None, None]  # 2^23 + q - (2^23 + z), exact
        # column j*GW + w of the group is nibble j of word w (w4a16/layout.py), i.e. this reshape's order
        a = tl.reshape(d.to(dt), [BLOCK_N, G])
        xt = tl.load(x_ptr + xr[None, :] * K + g * G + xk[:, None], mask=x_ok, other=0.0)  # [G, 16]
        acc += tl.dot(a, xt) * s[:, None]
    out = y_ptr + tl.program_id(1) * M * N + xr[None, :] * N + rows[:, None]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & x_ok)


def launch(x, qweight, scale_zero, out, group: int, block_n: int, split: int, warps: int, stages: int) -> None:
    """out: y [M, N] (split 1) or fp32 partials [split, M, N]."""
    n, kw = qweight.shape
    k = kw * 8
    w4a16_dot_kernel[(-(-n // block_n), split)](
        x, qweight, scale_zero, out, n, x.numel() // k, MAGIC, K=k, G=group, BLOCK_N=block_n, SPLIT=split,
        num_warps=warps, num_stages=stages)
