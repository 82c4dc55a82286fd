"""W4A16 GEMV (Triton) for decode: y = x @ dequant(W)^T with W kept as packed 4-bit codes in GPU memory.

At a few rows per step a projection's time is reading its weight once, so 4-bit codes (plus a scale and
a zero per group) move about 3.6x fewer bytes than fp16. The layout is engine/quant/w4a16_layout.py's:
int32 [N, K/8], within each group word w holds columns w + j*G/8 in nibble j, so for one nibble the
activations are one contiguous run, and the eight nibbles of a word share a scale and a zero.

Per word and nibble the kernel does a shift, a mask-or that lays the code into an fp32 mantissa
(0x4B000000 | q is the float 2^23 + q exactly), one subtraction of 2^23 + zero (exact: both are whole
numbers near 2^23), then one FMA per input row into a per-word fp32 sum; the word's sum is scaled once.
No int->float conversion instructions (quarter rate) and no tl.dot: plain FMAs and a final tl.sum,
which also compile for SM70. All rows (up to MAX_ROWS) share one dequantization of each tile.
The tile sizes are a fixed function of the shape and the row count (no autotuning), so a row's sum
runs in the same order on every call.

`w4a16_dequant` writes the dense weight (for calls of more rows, which then take the library GEMM).

Measured on an H200 (benchmarks/results/gpu_h200_w4a16.json): the GEMV is exact to its fp32 bound but
not yet fast: 12-20% of the copy bandwidth at one row, 0.5-0.7x the speed of the fp16 GEMV, and slower
than cuBLAS fp16 at 8 rows. What it gives today is a 3.6x smaller weight in GPU memory, not speed.
"""
from __future__ import annotations

import functools

import torch

MAX_ROWS = 8  # rows one GEMV call takes; more rows dequantize and use the library GEMM
MAX_K = 32768  # the K loop is unrolled


@functools.lru_cache(maxsize=1)
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def nibble(words, j: tl.constexpr, zc):
        """Code j of each word minus its zero, exact in fp32: (0x4B000000 | q) is the float 2^23 + q."""
        return (((words >> (4 * j)) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) - zc

    @triton.jit
    def xrow(x_ptr, xo, c_ok):
        return tl.load(x_ptr + xo, mask=c_ok, other=0.0).to(tl.float32)[None, :]

    @triton.jit
    def w4a16_gemv_kernel(x_ptr, q_ptr, s_ptr, z_ptr, y_ptr, N, K: tl.constexpr, G: tl.constexpr,
                          M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KW: tl.constexpr):
        # every tile is 2-D [BLOCK_N, BLOCK_KW words]; each input row (M <= 8, a compile-time count) has its
        # own accumulators (unused ones are compiled away). Nibbles are dequantized one at a time and fed to
        # every row, so only the words, their scale and zero, and the per-row sums stay live: few registers
        # per loaded byte, many tiles in flight per SM.
        GW: tl.constexpr = G // 8
        KW: tl.constexpr = K // 8
        NG: tl.constexpr = K // G
        pid = tl.program_id(0)
        rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < N
        rows = tl.where(row_ok, rows, 0).to(tl.int64)  # out-of-range rows re-read row 0 and are not stored
        acc0 = tl.zeros([BLOCK_N, BLOCK_KW], tl.float32)
        acc1 = tl.zeros([BLOCK_N, BLOCK_KW], tl.float32)
        acc2 = tl.zeros([BLOCK_N, BLOCK_KW], tl.float32)
        acc3 = tl.zeros([BLOCK_N, BLOCK_KW], tl.float32)
        acc4 = tl.zeros([BLOCK_N, BLOCK_KW], tl.float32)
        acc5 = tl.zeros([BLOCK_N, BLOCK_KW], tl.float32)
        acc6 = tl.zeros([BLOCK_N, BLOCK_KW], tl.float32)
        acc7 = tl.zeros([BLOCK_N, BLOCK_KW], tl.float32)
        for k0 in tl.static_range(0, KW, BLOCK_KW):
            cols = k0 + tl.arange(0, BLOCK_KW)
            c_ok = cols < KW
            words = tl.load(q_ptr + rows[:, None] * KW + cols[None, :], mask=c_ok[None, :], other=0,
                            eviction_policy="evict_first")
            grp = cols // GW
            s = tl.load(s_ptr + rows[:, None] * NG + grp[None, :], mask=c_ok[None, :], other=0.0).to(tl.float32)
            zc = tl.load(z_ptr + rows[:, None] * NG + grp[None, :], mask=c_ok[None, :], other=0.0).to(tl.float32)
            zc += 8388608.0
            xcol = grp * G + cols % GW
            t0 = tl.zeros([BLOCK_N, BLOCK_KW], tl.float32)
            t1 = tl.zeros([BLOCK_N, BLOCK_KW], tl.float32)
            t2 = tl.zeros([BLOCK_N, BLOCK_KW], tl.float32)
            t3 = tl.zeros([BLOCK_N, BLOCK_KW], tl.float32)
            t4 = tl.zeros([BLOCK_N, BLOCK_KW], tl.float32)
            t5 = tl.zeros([BLOCK_N, BLOCK_KW], tl.float32)
            t6 = tl.zeros([BLOCK_N, BLOCK_KW], tl.float32)
            t7 = tl.zeros([BLOCK_N, BLOCK_KW], tl.float32)
            for j in tl.static_range(8):
                d = nibble(words, j, zc)
                xo = xcol + j * GW
                t0 += d * xrow(x_ptr, xo, c_ok)
                if M > 1:
                    t1 += d * xrow(x_ptr + K, xo, c_ok)
                if M > 2:
                    t2 += d * xrow(x_ptr + 2 * K, xo, c_ok)
                if M > 3:
                    t3 += d * xrow(x_ptr + 3 * K, xo, c_ok)
                if M > 4:
                    t4 += d * xrow(x_ptr + 4 * K, xo, c_ok)
                if M > 5:
                    t5 += d * xrow(x_ptr + 5 * K, xo, c_ok)
                if M > 6:
                    t6 += d * xrow(x_ptr + 6 * K, xo, c_ok)
                if M > 7:
                    t7 += d * xrow(x_ptr + 7 * K, xo, c_ok)
            acc0 += t0 * s
            acc1 += t1 * s
            acc2 += t2 * s
            acc3 += t3 * s
            acc4 += t4 * s
            acc5 += t5 * s
            acc6 += t6 * s
            acc7 += t7 * s
        out_ty = y_ptr.dtype.element_ty
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

    return w4a16_gemv_kernel, w4a16_dequant_kernel


def default_config(n: int, k: int, m: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_KW, num_warps) for an [n, k] weight and m rows: ~1K words (8K weights) per tile at
    one row, fewer as the per-row accumulators grow."""
    block_kw = min(256, 1 << (k // 8 - 1).bit_length())
    block_n = max(1, min(16, 1024 // block_kw))
    if m > 4:
        block_n = max(1, block_n // 2)
    return block_n, block_kw, 4


def w4a16_unsupported_reason(x: torch.Tensor, qweight: torch.Tensor, group: int) -> str | None:
    """Why the GEMV cannot take the call (None: it can): contiguous fp16/bf16 CUDA input of at most MAX_ROWS
    rows, a CUDA packed weight whose K is a multiple of the group."""
    if not x.is_cuda or x.dtype not in (torch.float16, torch.bfloat16) or not qweight.is_cuda:
        return "CUDA float16/bfloat16 input and a CUDA packed weight required"
    k = qweight.shape[1] * 8
    if not x.is_contiguous() or x.shape[-1] != k or x.numel() > MAX_ROWS * k:
        return f"contiguous input of {k} features and at most {MAX_ROWS} rows"
    if k > MAX_K or k % group:
        return f"in_features a multiple of the group size and at most {MAX_K}"
    return None


def w4a16_gemv(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int,
               config: tuple[int, int, int] | None = None) -> torch.Tensor:
    """y = x @ dequant(W)^T for a contiguous x of at most MAX_ROWS rows, keeping x's leading shape and dtype."""
    n, kw = qweight.shape
    k = kw * 8
    m = x.numel() // k
    block_n, block_kw, warps = config or default_config(n, k, m)
    y = torch.empty(*x.shape[:-1], n, dtype=x.dtype, device=x.device)
    _kernels()[0][(-(-n // block_n),)](
        x, qweight, scales, zeros, y, n, K=k, G=group, M=m, BLOCK_N=block_n, BLOCK_KW=block_kw, num_warps=warps)
    return y


def w4a16_dequant(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int,
                  dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """The dense [N, K] weight in `dtype` (into `out` when given): (q - z) * s in fp32, rounded once."""
    n, kw = qweight.shape
    w = out if out is not None else torch.empty(n, kw * 8, dtype=dtype, device=qweight.device)
    block_n, block_kw = 16, 64
    _kernels()[1][(-(-n // block_n), -(-kw // block_kw))](
        qweight, scales, zeros, w, n, K=kw * 8, G=group, BLOCK_N=block_n, BLOCK_KW=block_kw, num_warps=4)
    return w
