"""W4A16 GEMV (Triton) for decode: y = x @ dequant(W)^T with W kept as packed 4-bit codes in GPU memory.

At a few rows per step a projection's time is reading its weight once, so 4-bit codes (plus a scale and
a zero per group) move about 3.6x fewer bytes than fp16. The layout is engine/quant/w4a16/layout.py's:
int32 [N, K/8], within each group word w holds columns w + j*G/8 in nibble j, so for one nibble the
activations are one contiguous run, and the eight nibbles of a word share a scale and a zero.

At 4 bits a weight the H200 streams about 32 weights per clock per SM, so the instructions spent per
weight decide the speed, not the bytes. Per word (8 weights) the kernel spends one shift, eight LOP3s
(mask a nibble and OR it into the mantissa of 2^23: nibbles 0-4 in place, since q * 16^j < 2^23, 5-7
from the upper half-word; the OR constant is a run-time argument so it sits in a register and mask+OR
stay one instruction), eight FFMAs that give q - z exactly in fp32 (v * 16^-j - (2^(23-4j) + z)), and
eight FFMAs against the activations; a word's products are summed and scaled once (more rows: a thread's
words of one group are summed in registers first, then scaled). Products exact, sums in fp32, no tl.dot:
it also compiles for SM70.

Tiles are [BLOCK_N rows, BLOCK_KW words]; each thread holds 8 words of a group for several rows, so the
activations it converts to fp32 serve all of them. Scales and zeros come as (scale, zero) pairs
(engine/quant/w4a16/layout.py scale_zero_pairs) read with a 2-wide contiguous pattern: that gives the load the
words' layout, where separate per-group loads made Triton 3.6 shuffle them through shared memory every tile.
The tile sizes are a fixed function of the shape and the row count (no autotuning), so a row's sum runs in
the same order on every call.

Measured on an H200 (Triton 3.6, CUDA-graph timing over rotating weights, benchmarks/results/quant_h200.json),
one row with the default tiles: qkv 8.8 us, o 6.2 us, gate_up 25.6 us, down 17.4 us; the four together
57.9 us, 47% of the copy bandwidth on the packed bytes, 1.86x faster than the fp16 GEMV on fp16 weights
(107.8 us). The shapes with 4096 output rows ran few warps per SM with 16-row tiles: o takes its whole
row in one 8-warp tile, down (K = 14336) splits K over 7 programs per tile (SPLIT: fp32 partials, summed
in a fixed order by split_sum_kernel, so a row's sum runs in the same order on every call). 2-8 rows on
SM80+ take the tensor-core path (triton_w4a16_dot.py): 24-107 us at 8 rows, still 1.8x slower than cuBLAS
on fp16 weights over a layer; below SM80 the FMA GEMV here (4-row tiles).

`w4a16_dequant` writes the dense weight (for calls of more rows, which then take the library GEMM).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from onecat.engine.kernels.device import capability

MAX_ROWS = 8  # rows one GEMV call takes; more rows dequantize and use the library GEMM
MAX_K = 32768  # the K loop is unrolled
MAGIC = 0x4B000000  # the bits of 2^23 as a float


@triton.jit
def code(words, hi, zf, magic, j: tl.constexpr):
    """q_j - z, exact in fp32: (q * 16^j | bits of 2^23) is the float 2^23 + q * 16^j."""
    if j < 5:
        v = ((words & (0xF << (4 * j))) | magic).to(tl.float32, bitcast=True)
        d = v * (1.0 / (1 << (4 * j))) - (zf + (1 << (23 - 4 * j)))
    else:
        v = ((hi & (0xF << (4 * (j - 4)))) | magic).to(tl.float32, bitcast=True)
        d = v * (1.0 / (1 << (4 * (j - 4)))) - (zf + (1 << (23 - 4 * (j - 4))))
    return d

@triton.jit
def xval(x_ptr, xo):
    return tl.load(x_ptr + xo).to(tl.float32)

@triton.jit
def group_sum(p, GW: tl.constexpr):
    """[rows, words] -> [rows, words / R]: sums of R = min(8, G/8) neighbouring words (one group's, held
    by one thread)."""
    R: tl.constexpr = 8 if GW > 8 else GW
    return tl.sum(tl.reshape(p, [p.shape[0], p.shape[1] // R, R]), axis=2)

@triton.jit
def group_first(v, GW: tl.constexpr):
    """[rows, words] -> [rows, words / R]: the first of each R neighbouring words (equal within a group)."""
    R: tl.constexpr = 8 if GW > 8 else GW
    return tl.max(tl.reshape(v, [v.shape[0], v.shape[1] // R, R]), axis=2)

@triton.jit
def tile(x_ptr, q_ptr, sz_ptr, rows, c, k0, magic, acc0, acc1, acc2, acc3, acc4, acc5, acc6,
         acc7, K: tl.constexpr, G: tl.constexpr, M: tl.constexpr):
    """One [rows, words] tile of K added into each input row's accumulators."""
    GW: tl.constexpr = G // 8
    KW: tl.constexpr = K // 8
    NG: tl.constexpr = K // G
    cols = k0 + c  # word index along the row
    words = tl.load(q_ptr + rows * KW + cols, eviction_policy="evict_first")
    # sz holds (scale, zero) pairs; element c loads pair member c % 2 of its group (2-wide contiguous
    # runs, the words' access order), then each thread splits its run into scales and zeros
    sz = tl.load(sz_ptr + rows * (2 * NG) + (cols // GW) * 2 + cols % 2)
    sv, zv = tl.split(tl.reshape(sz, [sz.shape[0], sz.shape[1] // 2, 2]))
    s = tl.reshape(tl.join(sv, sv), sz.shape).to(tl.float32)
    zf = tl.reshape(tl.join(zv, zv), sz.shape).to(tl.float32)
    hi = words >> 16
    xo = (cols // GW) * G + cols % GW + (rows * 0).to(tl.int32)
    if M == 1:
        t = code(words, hi, zf, magic, 0) * xval(x_ptr, xo)
        for j in tl.static_range(1, 8):
            t += code(words, hi, zf, magic, j) * xval(x_ptr, xo + j * GW)
        acc0 += t * s
    else:
        # every row's products of a word are summed, the thread's words of one group are summed in
        # registers, and the group's scale is applied once: per weight and row one FFMA
        d0 = code(words, hi, zf, magic, 0)
        p0 = d0 * xval(x_ptr, xo)
        p1 = d0 * xval(x_ptr + K, xo)
        p2 = d0 * xval(x_ptr + 2 * K, xo)
        p3 = d0 * xval(x_ptr + 3 * K, xo)
        p4 = d0 * xval(x_ptr + 4 * K, xo)
        p5 = d0 * xval(x_ptr + 5 * K, xo)
        p6 = d0 * xval(x_ptr + 6 * K, xo)
        p7 = d0 * xval(x_ptr + 7 * K, xo)
        for j in tl.static_range(1, 8):
            d = code(words, hi, zf, magic, j)
            xj = xo + j * GW
            p0 += d * xval(x_ptr, xj)
            p1 += d * xval(x_ptr + K, xj)
            if M > 2:
                p2 += d * xval(x_ptr + 2 * K, xj)
            if M > 3:
                p3 += d * xval(x_ptr + 3 * K, xj)
            if M > 4:
                p4 += d * xval(x_ptr + 4 * K, xj)
            if M > 5:
                p5 += d * xval(x_ptr + 5 * K, xj)
            if M > 6:
                p6 += d * xval(x_ptr + 6 * K, xj)
            if M > 7:
                p7 += d * xval(x_ptr + 7 * K, xj)
        acc0 += group_sum(p0, GW) * group_first(s, GW)
        acc1 += group_sum(p1, GW) * group_first(s, GW)
        if M > 2:
            acc2 += group_sum(p2, GW) * group_first(s, GW)
        if M > 3:
            acc3 += group_sum(p3, GW) * group_first(s, GW)
        if M > 4:
            acc4 += group_sum(p4, GW) * group_first(s, GW)
        if M > 5:
            acc5 += group_sum(p5, GW) * group_first(s, GW)
        if M > 6:
            acc6 += group_sum(p6, GW) * group_first(s, GW)
        if M > 7:
            acc7 += group_sum(p7, GW) * group_first(s, GW)
    return acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7

@triton.jit
def w4a16_gemv_kernel(x_ptr, q_ptr, sz_ptr, y_ptr, N, magic, K: tl.constexpr,
                      G: tl.constexpr, M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KW: tl.constexpr,
                      SPLIT: tl.constexpr = 1):
    """SPLIT > 1: program (i, s) sums the s-th of SPLIT equal runs of K into fp32 partials at y_ptr
    ([SPLIT, M, N]); split_sum_kernel adds them in a fixed order."""
    KWS: tl.constexpr = K // 8 // SPLIT  # words of one split
    kbase = tl.program_id(1) * KWS
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    rows = tl.where(row_ok, rows, 0).to(tl.int64)[:, None]  # out-of-range rows re-read row 0, not stored
    c = tl.arange(0, BLOCK_KW)[None, :]
    GW: tl.constexpr = G // 8
    AW: tl.constexpr = BLOCK_KW if M == 1 else BLOCK_KW // (8 if GW > 8 else GW)  # accumulator width
    acc0 = tl.zeros([BLOCK_N, AW], tl.float32)
    acc1 = tl.zeros([BLOCK_N, AW], tl.float32)
    acc2 = tl.zeros([BLOCK_N, AW], tl.float32)
    acc3 = tl.zeros([BLOCK_N, AW], tl.float32)
    acc4 = tl.zeros([BLOCK_N, AW], tl.float32)
    acc5 = tl.zeros([BLOCK_N, AW], tl.float32)
    acc6 = tl.zeros([BLOCK_N, AW], tl.float32)
    acc7 = tl.zeros([BLOCK_N, AW], tl.float32)
    # one row: the K loop is unrolled (loads of later tiles issue early); more rows: a loop, since the
    # unrolled many-row body takes ptxas minutes at K = 14336
    if M == 1:
        for k0 in tl.static_range(0, KWS, BLOCK_KW):  # BLOCK_KW divides K/8/SPLIT: no masks
            acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7 = tile(
                x_ptr, q_ptr, sz_ptr, rows, c, kbase + k0, magic, acc0, acc1, acc2, acc3, acc4, acc5,
                acc6, acc7, K, G, M)
    else:
        for k0 in tl.range(0, KWS, BLOCK_KW):
            acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7 = tile(
                x_ptr, q_ptr, sz_ptr, rows, c, kbase + k0, magic, acc0, acc1, acc2, acc3, acc4, acc5,
                acc6, acc7, K, G, M)
    rows = rows.reshape(BLOCK_N)
    out_ty = y_ptr.dtype.element_ty
    y_ptr += tl.program_id(1) * M * N  # this split's partials (SPLIT 1: the output itself)
    tl.store(y_ptr + rows, tl.sum(acc0, axis=1).to(out_ty), mask=row_ok)
    if M > 1:
        tl.store(y_ptr + N + rows, tl.sum(acc1, axis=1).to(out_ty), mask=row_ok)
    if M > 2:
        tl.store(y_ptr + 2 * N + rows, tl.sum(acc2, axis=1).to(out_ty), mask=row_ok)
    if M > 3:
        tl.store(y_ptr + 3 * N + rows, tl.sum(acc3, axis=1).to(out_ty), mask=row_ok)
    if M > 4:
        tl.store(y_ptr + 4 * N + rows, tl.sum(acc4, axis=1).to(out_ty), mask=row_ok)
    if M > 5:
        tl.store(y_ptr + 5 * N + rows, tl.sum(acc5, axis=1).to(out_ty), mask=row_ok)
    if M > 6:
        tl.store(y_ptr + 6 * N + rows, tl.sum(acc6, axis=1).to(out_ty), mask=row_ok)
    if M > 7:
        tl.store(y_ptr + 7 * N + rows, tl.sum(acc7, axis=1).to(out_ty), mask=row_ok)

@triton.jit(do_not_specialize=["MN"])  # one build for every row count (triton_builds.py says why)
def split_sum_kernel(part_ptr, y_ptr, MN, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    """y = the SPLIT fp32 partials [SPLIT, M*N] summed in split order (the same order on every call)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < MN
    acc = tl.load(part_ptr + offs, mask=ok, other=0.0)
    for s in tl.static_range(1, SPLIT):
        acc += tl.load(part_ptr + s * MN + offs, mask=ok, other=0.0)
    tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=ok)

@triton.jit
def w4a16_dequant_kernel(q_ptr, s_ptr, z_ptr, w_ptr, N, K: tl.constexpr, G: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_KW: tl.constexpr):
    GW: tl.constexpr = G // 8
    KW: tl.constexpr = K // 8
    NG: tl.constexpr = K // G
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.program_id(1) * BLOCK_KW + tl.arange(0, BLOCK_KW)
    ok = (rows < N)[:, None] & (cols < KW)[None, :]
    rows = rows.to(tl.int64)
    words = tl.load(q_ptr + rows[:, None] * KW + cols[None, :], mask=ok, other=0)
    grp = cols // GW
    s = tl.load(s_ptr + rows[:, None] * NG + grp[None, :], mask=ok, other=0.0).to(tl.float32)
    zc = tl.load(z_ptr + rows[:, None] * NG + grp[None, :], mask=ok, other=0.0).to(tl.float32) + 8388608.0
    out = w_ptr + rows[:, None] * K + (grp * G + cols % GW)[None, :]
    for j in tl.static_range(8):
        qf = (((words >> (4 * j)) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) - zc
        tl.store(out + j * GW, (qf * s).to(w_ptr.dtype.element_ty), mask=ok)


def _words_per_tile(kw: int, want: int) -> int:
    """The largest power of two <= want that divides the row's word count (the K loop has no masks)."""
    b = want
    while kw % b:
        b //= 2
    return b


def default_config(n: int, k: int, m: int, sm: int | None = None) -> tuple:
    """The tile config for an [n, k] weight, m rows and compute capability sm (e.g. 90): FMA tiles
    (BLOCK_N, BLOCK_KW, num_warps, SPLIT), or ("dot", BLOCK_N, num_warps, num_stages, SPLIT) for the
    tensor-core path. Chosen from the H200 sweep of the 8B projections (benchmarks/results/quant_h200.json):
    one row: 16 rows of 2 warps and 128-word tiles where that gives at least 384 programs (qkv 8.8 us,
    gate_up 25.6 us); fewer output rows (4096) leave SMs idle, so the whole K = 4096 row in one 8-warp tile
    (o: 6.2 us, was 8.2) or K split into 256-word runs (down, K = 14336: 7 splits, 17.4 us, was 38.4).
    2-8 rows on SM80+: the tensor-core path, 64-row tiles with K split in two for 6144+ rows, else 32-row
    tiles split in four. Below SM80, 2-8 rows: FMA tiles of 4 rows (8 spill on sm_70, offline ptxas)."""
    kw = k // 8
    bkw = _words_per_tile(kw, 128)
    if m == 1:
        if -(-n // 16) >= 384:
            return 16, bkw, 2, 1
        if kw in (256, 512):
            return 16, kw, kw // 64, 1
        if kw % 256 == 0 and kw // 256 <= 16:
            return 16, 256, 4, kw // 256
        return 16, bkw, 2, 1
    if sm is not None and sm < 80:
        return 4, bkw, 2, 1
    groups = k // 128 if k % 128 == 0 else 0  # the group size is not known here: split only where any divides
    if n >= 6144:
        return ("dot", 64, 4, 3, 2 if groups and groups % 2 == 0 else 1)
    return ("dot", 32, 4, 3, 4 if groups and groups % 4 == 0 else 1)


def w4a16_unsupported_reason(x: torch.Tensor, qweight: torch.Tensor, group: int) -> str | None:
    """Why the GEMV cannot take the call (None: it can): contiguous fp16/bf16 CUDA input of at most MAX_ROWS
    rows, a CUDA packed weight whose K is a multiple of the group."""
    if not x.is_cuda or x.dtype not in (torch.float16, torch.bfloat16) or not qweight.is_cuda:
        return "CUDA float16/bfloat16 input and a CUDA packed weight required"
    k = qweight.shape[1] * 8
    if not x.is_contiguous() or x.shape[-1] != k or x.numel() > MAX_ROWS * k:
        return f"contiguous input of {k} features and at most {MAX_ROWS} rows"
    if k > MAX_K or k % group or k % 64:
        return f"in_features a multiple of 64 and of the group size, at most {MAX_K}"
    return None


def w4a16_gemv(x: torch.Tensor, qweight: torch.Tensor, scale_zero: torch.Tensor, group: int,
               config: tuple[int, ...] | None = None) -> torch.Tensor:
    """y = x @ dequant(W)^T for a contiguous x of at most MAX_ROWS rows, keeping x's leading shape and dtype;
    scale_zero from engine/quant/w4a16/layout.py scale_zero_pairs; config (BLOCK_N, BLOCK_KW, num_warps[, SPLIT])
    overrides the default."""
    n, kw = qweight.shape
    k = kw * 8
    m = x.numel() // k
    config = config or default_config(
        n, k, m, capability(x.device.index if x.device.index is not None else torch.cuda.current_device()))
    y = torch.empty(*x.shape[:-1], n, dtype=x.dtype, device=x.device)
    if config[0] == "dot":  # ("dot", BLOCK_N, num_warps, num_stages, SPLIT): tensor cores, SM80+
        from onecat.engine.kernels import triton_w4a16_dot as dot

        _, block_n, warps, stages, split = config
        if (k // group) % split or block_n < 16:
            raise ValueError(f"SPLIT {split} must divide the {k // group} groups and BLOCK_N {block_n} be >= 16")
        out = y if split == 1 else torch.empty(split, m, n, dtype=torch.float32, device=x.device)
        dot.launch(x, qweight, scale_zero, out, group, block_n, split, warps, stages)
        return y if split == 1 else split_sum(out, y, m * n, split)
    block_n, block_kw, warps, *rest = config
    split = rest[0] if rest else 1
    if kw % (block_kw * split) or block_kw % 8:
        raise ValueError(f"BLOCK_KW {block_kw} times SPLIT {split} must divide the row's {kw} words "
                         "(BLOCK_KW a multiple of 8)")
    out = y if split == 1 else torch.empty(split, m, n, dtype=torch.float32, device=x.device)
    w4a16_gemv_kernel[(-(-n // block_n), split)](
        x, qweight, scale_zero, out, n, MAGIC, K=k, G=group, M=m, BLOCK_N=block_n, BLOCK_KW=block_kw,
        SPLIT=split, num_warps=warps)
    return y if split == 1 else split_sum(out, y, m * n, split)


def split_sum(part: torch.Tensor, y: torch.Tensor, mn: int, split: int) -> torch.Tensor:
    """y = the fp32 partials [split, M*N] of a K-split GEMV summed in split order (the FP4 GEMV's too)."""
    split_sum_kernel[(-(-mn // 1024),)](part, y, mn, SPLIT=split, BLOCK=1024, num_warps=4)
    return y


def w4a16_dequant(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int,
                  dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """The dense [N, K] weight in `dtype` (into `out` when given): (q - z) * s in fp32, rounded once."""
    n, kw = qweight.shape
    w = out if out is not None else torch.empty(n, kw * 8, dtype=dtype, device=qweight.device)
    block_n, block_kw = 16, 64
    w4a16_dequant_kernel[(-(-n // block_n), -(-kw // block_kw))](
        qweight, scales, zeros, w, n, K=kw * 8, G=group, BLOCK_N=block_n, BLOCK_KW=block_kw, num_warps=4)
    return w
