"""FP4 (E2M1) GEMV for decode, NVFP4 and MXFP4 weights kept packed in GPU memory; plain FMAs (runs on SM70).

Layout (engine/quant/fp4/layout.py): int32 codes [N, K/8], within each block of B columns (16 for NVFP4,
32 for MXFP4) word w holds columns w + j*B/8 as code j (its bits placed in fp4.layout.SLOTS), so for one j
the activations are a contiguous run; the block scales stay the checkpoint's bytes [N, K/B] (E4M3 for NVFP4,
E8M0 for MXFP4), and NVFP4 has a float32 global scale per output row (fused q/k/v keep each shard's).

Decode without a table: a code's sign moved to bit 31 and its three magnitude bits to bits 22-24 of a
float32 (one rotate and one mask for six of the eight codes of a word, two of each for the others) give
exactly e2m1 * 2^-126 (E2M1's subnormal 0.5 becomes a float32 subnormal; Triton's plain
multiplies keep subnormals). The activations are pre-scaled by 2^100 and the block scale by 2^26, so every
product is a normal float32, exact (2 significant bits times 11), summed in fp32. A block scale is decoded
the same way (E4M3: its bits at 20-30 give the value * 2^-120; E8M0: (e + 26) << 23 is 2^(e-127) * 2^26)
and, for NVFP4, multiplied by the global scale in float32 first, as the reference dequantizer forms it.
So the result obeys the W4A16 GEMV's bound (exact products, fp32 sums, one rounding of the output).

Measured on an H200 (benchmarks/results/quant_h200.json, "fp4"), one row over the four 8B projections with
the default tiles: NVFP4 127.6 us (23% of the copy bandwidth on the packed bytes; cuBLAS on fp16 weights
120.8 us), MXFP4 93.6 us (29%). Short of the 70% target, and not explained by measurement: cutting the
decode from 32 to 20 integer ops per word (SLOTS) and loading one tile ahead changed the times by under 10%.
"""
from __future__ import annotations

import os

import triton
import triton.language as tl

USE_ASM = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") != "1")
NVFP4, MXFP4 = 0, 1
BLOCK = {NVFP4: 16, MXFP4: 32}
MAX_ROWS = 8
X_PRESCALE = tl.constexpr(2.0 ** 100)  # activations * 2^100 keep the products of subnormal-encoded codes normal


@triton.jit
def rotl(w, r: tl.constexpr):
    """w rotated left by r: one funnel shift (SHF.L.W; LLVM does not form it from two shifts and an OR)."""
    if r == 0:
        return w
    elif USE_ASM:
        return tl.inline_asm_elementwise(f"shf.l.wrap.b32 $0, $1, $1, {r};", "=r,r", [w], dtype=tl.uint32,
                                         is_pure=True, pack=1)
    else:  # the Triton interpreter runs no PTX
        return (w << r) | (w >> (32 - r))


@triton.jit
def take(w, r: tl.constexpr, mask: tl.constexpr):
    return rotl(w, r) & mask


@triton.jit
def e2m1_times_2m126(w, j: tl.constexpr):
    """Code j of the uint32 words (fp4.layout.SLOTS) as float32 e2m1 * 2^-126: rotations and masks move its
    sign to bit 31 and its magnitude bits to 22-24."""
    if j == 0:
        bits = take(w, 22, 0x81C00000)
    elif j == 1:
        bits = take(w, 19, 0x81C00000)
    elif j == 2:
        bits = take(w, 16, 0x81C00000)
    elif j == 3:
        bits = take(w, 12, 0x80C00000) | take(w, 0, 0x01000000)
    elif j == 4:
        bits = take(w, 9, 0x00C00000) | take(w, 1, 0x81000000)
    elif j == 5:
        bits = take(w, 6, 0x81C00000)
    elif j == 6:
        bits = take(w, 2, 0x81C00000)
    else:
        bits = take(w, 28, 0x01C00000) | take(w, 0, 0x80000000)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def code_places(j):
    """For codes j (a tensor of 0-7; fp4.layout.SLOTS), the left rotations and masks (r1, m1, r2, m2) that move a
    code's sign to bit 31 and its magnitude to bits 22-24 (code_bits): e2m1_times_2m126's, chosen per element,
    for kernels that decode all eight codes of a word at once along an axis."""
    r1 = tl.where(j == 0, 22, tl.where(j == 1, 19, tl.where(j == 2, 16, tl.where(j == 3, 12, tl.where(
        j == 4, 9, tl.where(j == 5, 6, tl.where(j == 6, 2, 28))))))).to(tl.uint32)
    m1 = tl.where(j == 3, 0x80C00000, tl.where(j == 4, 0x00C00000, tl.where(j == 7, 0x01C00000, 0x81C00000)))
    r2 = tl.where(j == 4, 1, 0).to(tl.uint32)
    m2 = tl.where(j == 3, 0x01000000, tl.where(j == 4, 0x81000000, tl.where(j == 7, 0x80000000, 0)))
    return r1, m1.to(tl.uint32), r2, m2.to(tl.uint32)


@triton.jit
def code_bits(w, r1, m1, r2, m2):
    """The codes of uint32 words w placed by code_places' (r1, m1, r2, m2): bitcast to float32 they are e2m1 *
    2^-126 (rotations by tensors: (w << r) | (w >> (32 - r)), the shift of 32 masked to 0)."""
    return (((w << r1) | (w >> ((32 - r1) & 31))) & m1) | (((w << r2) | (w >> ((32 - r2) & 31))) & m2)


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
    # the next tile's words and scale bytes load while this one computes (the last step re-reads its own)
    w_next = tl.load(q_ptr + rows * KW + kbase + c, eviction_policy="evict_first")
    sb_next = tl.load(s_ptr + rows * NB + (kbase + c) // GW)
    for k0 in tl.range(0, KWS, BLOCK_KW):
        cols = kbase + k0 + c
        w = w_next.to(tl.uint32, bitcast=True)
        s = block_scale(sb_next, gscale, FMT)
        nxt = kbase + tl.minimum(k0 + BLOCK_KW, KWS - BLOCK_KW) + c
        w_next = tl.load(q_ptr + rows * KW + nxt, eviction_policy="evict_first")
        sb_next = tl.load(s_ptr + rows * NB + nxt // GW)
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


@triton.jit
def fp4_dequant_kernel(q_ptr, s_ptr, g_ptr, w_ptr, N, K: tl.constexpr, FMT: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_KW: tl.constexpr):
    """The dense weight [N, K]: each code's e2m1 value times its block's scale in float32 (the scale formed as
    the reference forms it), rounded once to the output dtype, as fp4.layout.dequantize then .to(dtype) does."""
    B: tl.constexpr = 16 if FMT == 0 else 32
    GW: tl.constexpr = B // 8
    KW: tl.constexpr = K // 8
    NB: tl.constexpr = K // B
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.program_id(1) * BLOCK_KW + tl.arange(0, BLOCK_KW)
    ok = (rows < N)[:, None] & (cols < KW)[None, :]
    rows = tl.where(rows < N, rows, 0).to(tl.int64)[:, None]
    words = tl.load(q_ptr + rows * KW + cols[None, :], mask=ok, other=0).to(tl.uint32, bitcast=True)
    sb = tl.load(s_ptr + rows * NB + (cols // GW)[None, :], mask=ok, other=0)
    gscale = tl.load(g_ptr + rows) if FMT == 0 else 1.0
    scale = block_scale(sb, gscale, FMT) * (2.0 ** -26)  # exact: the block's scale
    if FMT == 1:
        scale = tl.where(sb.to(tl.uint32) == 255, float("nan"), scale)  # E8M0 255 is NaN
    out = w_ptr + rows * K + ((cols // GW) * B + cols % GW)[None, :]
    for j in tl.static_range(8):
        value = e2m1_times_2m126(words, j) * (2.0 ** 126)  # exact: the code's e2m1 value
        tl.store(out + j * GW, (value * scale).to(w_ptr.dtype.element_ty), mask=ok)


@triton.jit
def slots_dequant_kernel(q_ptr, s_ptr, g_ptr, w_ptr, N, K: tl.constexpr, FMT: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, M0: tl.constexpr, M1: tl.constexpr, M2: tl.constexpr,
                         M3: tl.constexpr, S0: tl.constexpr, S1: tl.constexpr, S2: tl.constexpr, S3: tl.constexpr):
    """fp4_dequant_kernel for words in code slots (engine/quant/fp4/slots.py: word i holds columns 8i .. 8i + 7,
    slot j // 2, first or second code by j % 2; MXFP4 each 32 columns in MXFP4_ORDER). One lane per output
    column, so the stores are contiguous; the eight lanes of a word read it together. M*, S*: each slot's
    first-code magnitude and sign bit (SlotLayout.magnitude_at / sign_at); the second code's sit 16 bits on."""
    B: tl.constexpr = 16 if FMT == 0 else 32
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    ok = (rows < N)[:, None] & (cols < K)[None, :]
    rows = tl.where(rows < N, rows, 0).to(tl.int64)[:, None]
    sb = tl.load(s_ptr + rows * (K // B) + (cols // B)[None, :], mask=ok, other=0)
    gscale = tl.load(g_ptr + rows) if FMT == 0 else 1.0
    scale = block_scale(sb, gscale, FMT) * (2.0 ** -26)  # exact: the block's scale
    if FMT == 1:
        scale = tl.where(sb.to(tl.uint32) == 255, float("nan"), scale)  # E8M0 255 is NaN
    pair = (cols % 32) // 2  # the word and slot of a column's pair (MXFP4: fp4.slots.MXFP4_ORDER)
    at = pair if FMT == 0 else tl.where(pair % 2 == 0, pair // 2, 8 + pair // 2)
    word, slot, half = (cols // 32) * 4 + at // 4, at % 4, 16 * (cols % 2)
    m_at = (tl.where(slot == 0, M0, tl.where(slot == 1, M1, tl.where(slot == 2, M2, M3))) + half) % 32
    s_at = (tl.where(slot == 0, S0, tl.where(slot == 1, S1, tl.where(slot == 2, S2, S3))) + half) % 32
    words = tl.load(q_ptr + rows * (K // 8) + word[None, :], mask=ok, other=0).to(tl.uint32, bitcast=True)
    magnitude = (words >> m_at[None, :].to(tl.uint32)) & 7  # three bits in a row, never across bit 31
    sign = (words >> s_at[None, :].to(tl.uint32)) & 1
    value = ((sign << 31) | (magnitude << 22)).to(tl.float32, bitcast=True) * (2.0 ** 126)  # exact: e2m1
    tl.store(w_ptr + rows * K + cols[None, :], (value * scale).to(w_ptr.dtype.element_ty), mask=ok)


def dequantize(qweight, scales, gscale, fmt: int, dtype, slots=None):
    """The dense [N, K] weight in `dtype` on qweight's device (row-major words, or in the code slots of the
    activation dtype `slots` where given; gscale: float32 [N] for NVFP4, any tensor for MXFP4)."""
    import torch

    n, kw = qweight.shape
    w = torch.empty(n, kw * 8, dtype=dtype, device=qweight.device)
    if slots is not None:
        from onecat.engine.kernels.fp4_slot_bits import SLOTS

        layout, block_n, block_k = SLOTS[slots], 16, 256
        slots_dequant_kernel[(-(-n // block_n), -(-kw * 8 // block_k))](
            qweight, scales, gscale, w, n, K=kw * 8, FMT=fmt, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4,
            **{f"M{s}": layout.magnitude_at(s, 0) for s in range(4)},
            **{f"S{s}": layout.sign_at(s, 0) for s in range(4)})
        return w
    block_n, block_kw = 16, 64
    fp4_dequant_kernel[(-(-n // block_n), -(-kw // block_kw))](
        qweight, scales, gscale, w, n, K=kw * 8, FMT=fmt, BLOCK_N=block_n, BLOCK_KW=block_kw, num_warps=4)
    return w
