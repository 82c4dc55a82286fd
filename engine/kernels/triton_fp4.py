"""FP4 (E2M1) GEMV for decode, NVFP4 and MXFP4 weights kept packed in GPU memory; plain FMAs (runs on SM70).

Layout (engine/quant/fp4_layout.py): int32 codes [N, K/8], within each block of B columns (16 for NVFP4,
32 for MXFP4) word w holds columns w + j*B/8 in nibble j (bit 3 the sign), so for one nibble the
activations are a contiguous run; the block scales stay the checkpoint's bytes [N, K/B] (E4M3 for NVFP4,
E8M0 for MXFP4), and NVFP4 has a float32 global scale per output row (fused q/k/v keep each shard's).

Decode without a table: a code's sign moved to bit 31 and its three magnitude bits to bits 22-24 of a
float32 give exactly e2m1 * 2^-126 (E2M1's subnormal 0.5 becomes a float32 subnormal; Triton's plain
multiplies keep subnormals). The activations are pre-scaled by 2^100 and the block scale by 2^26, so every
product is a normal float32, exact (2 significant bits times 11), summed in fp32. A block scale is decoded
the same way (E4M3: its bits at 20-30 give the value * 2^-120; E8M0: (e + 26) << 23 is 2^(e-127) * 2^26)
and, for NVFP4, multiplied by the global scale in float32 first, as the reference dequantizer forms it.
So the result obeys the W4A16 GEMV's bound (exact products, fp32 sums, one rounding of the output).

This module imports Triton at load; engine/quant/fp4_linear.py imports it only on CUDA.
"""
from __future__ import annotations

import triton
import triton.language as tl

NVFP4, MXFP4 = 0, 1
BLOCK = {NVFP4: 16, MXFP4: 32}
MAX_ROWS = 8
X_PRESCALE = tl.constexpr(2.0 ** 100)  # activations * 2^100 keep the products of subnormal-encoded codes normal


@triton.jit
def e2m1_times_2m126(w, j: tl.constexpr):
    """Nibble j of the uint32 words as float32 e2m1 * 2^-126: sign to bit 31, magnitude to bits 22-24."""
    if j < 7:
        p = w << (28 - 4 * j)
    else:
        p = w
    bits = (p & 0x80000000) | ((p >> 6) & 0x01C00000)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def block_scale(b, gscale, FMT: tl.constexpr):
    """Scale bytes -> the block's scale * 2^26 in float32 (NVFP4: E4M3 * global, rounded once, as the
    reference forms it)."""
    b = b.to(tl.uint32)
    if FMT == 0:
        e4m3 = (((b & 0x80) << 24) | ((b & 0x7F) << 20)).to(tl.float32, bitcast=True) * (2.0 ** 120)
        return (e4m3 * gscale) * (2.0 ** 26)
    else:
        return ((b + 26) << 23).to(tl.float32, bitcast=True)


@triton.jit
def fp4_gemv_kernel(x_ptr, q_ptr, s_ptr, g_ptr, y_ptr, N, M: tl.constexpr, MP: tl.constexpr, K: tl.constexpr,
                    FMT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KW: tl.constexpr, SPLIT: tl.constexpr):
    B: tl.constexpr = 16 if FMT == 0 else 32
    GW: tl.constexpr = B // 8  # words per block
    KW: tl.constexpr = K // 8
    NB: tl.constexpr = K // B
    KWS: tl.constexpr = KW // SPLIT
    kbase = tl.program_id(1) * KWS
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    rows = tl.where(row_ok, rows, 0).to(tl.int64)[:, None]  # out-of-range rows re-read row 0, not stored
    gscale = tl.load(g_ptr + rows) if FMT == 0 else 1.0
    c = tl.arange(0, BLOCK_KW)[None, :]
    if M == 1:
        acc = tl.zeros([BLOCK_N, BLOCK_KW], tl.float32)
    else:
        acc = tl.zeros([MP, BLOCK_N, BLOCK_KW], tl.float32)
        mr = tl.arange(0, MP)[:, None, None]
        m_ok = mr < M
    for k0 in tl.range(0, KWS, BLOCK_KW):  # a loop: unrolled (K = 4096) it spills at 255 registers on sm_90
        cols = kbase + k0 + c
        w = tl.load(q_ptr + rows * KW + cols, eviction_policy="evict_first").to(tl.uint32, bitcast=True)
        s = block_scale(tl.load(s_ptr + rows * NB + cols // GW), gscale, FMT)
        xo = (cols // GW) * B + cols % GW + (rows * 0).to(tl.int32)  # the words' 2-D shape: same layout, no shuffle
        if M == 1:
            t = e2m1_times_2m126(w, 0) * (tl.load(x_ptr + xo).to(tl.float32) * X_PRESCALE)
            for j in tl.static_range(1, 8):
                t += e2m1_times_2m126(w, j) * (tl.load(x_ptr + xo + j * GW).to(tl.float32) * X_PRESCALE)
            acc += t * s
        else:
            xo3 = mr * K + xo[None, :, :]
            t = e2m1_times_2m126(w, 0)[None, :, :] * (
                tl.load(x_ptr + xo3, mask=m_ok, other=0.0).to(tl.float32) * X_PRESCALE)
            for j in tl.static_range(1, 8):
                t += e2m1_times_2m126(w, j)[None, :, :] * (
                    tl.load(x_ptr + xo3 + j * GW, mask=m_ok, other=0.0).to(tl.float32) * X_PRESCALE)
            acc += t * s[None, :, :]
    y_ptr += tl.program_id(1) * M * N  # this split's fp32 partials (SPLIT 1: the output itself)
    out_ty = y_ptr.dtype.element_ty
    if M == 1:
        tl.store(y_ptr + rows, tl.sum(acc, axis=1)[:, None].to(out_ty), mask=row_ok[:, None])
    else:
        out = y_ptr + mr.reshape(MP, 1) * N + rows.reshape(1, BLOCK_N)
        tl.store(out, tl.sum(acc, axis=2).to(out_ty), mask=(mr.reshape(MP, 1) < M) & row_ok[None, :])


def launch(x, qweight, scales, gscale, out, fmt: int, block_n: int, block_kw: int, warps: int, split: int) -> None:
    """out: y [M, N] (split 1) or fp32 partials [split, M, N]; gscale: float32 [N] (NVFP4) or any tensor."""
    n, kw = qweight.shape
    k = kw * 8
    m = x.numel() // k
    fp4_gemv_kernel[(-(-n // block_n), split)](
        x, qweight, scales, gscale, out, n, M=m, MP=triton.next_power_of_2(m), K=k, FMT=fmt, BLOCK_N=block_n,
        BLOCK_KW=block_kw, SPLIT=split, num_warps=warps)
