"""Batch-1 GEMV (Triton) for decode: y = W x with the weight streamed at full memory bandwidth.

At one token per step every projection is a matrix-vector product: all its time is reading W once.
cuBLAS picks split-K GEMM kernels for the smaller projections (q/k/v, o), which reach ~70-80% of
the bandwidth and add a reduce kernel each. This kernel gives every program a few whole output
rows, walks K in wide unrolled tiles so many loads are in flight per SM, keeps an fp32 accumulator
per element and reduces once at the end: no split-K, one launch.

It also folds in the small ops around a projection, so a decoder layer's MLP half is two kernels:
  norm   the input is RMSNorm(x + residual) * norm_weight; x + residual is also stored (the new
         residual stream). The RMS statistic is gathered in the same pass as the products and
         applied to the row sums at the end (one pass, nothing serial before the weight loads),
         so the normalized input is not rounded to fp16 as the separate kernel would: results
         agree with the two-kernel path to fp16 rounding, not bit for bit.
  glu    W is a fused [gate | up] projection: each program computes gate row i and up row i and
         writes SiLU(gate) * up, rounded as the projection output and the activation would be.
The tile sizes are a fixed function of the shape (no autotuning), so a model sums in the same
order on every run.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from onecat.engine.kernels import pdl

MAX_K = 32768  # the K loop is unrolled: larger inputs take the library GEMM
MAX_ROWS = 16  # rows of one call
# Calls of several rows (a batch-1 verify step): one program walks every row of its tile (True) or one
# program per row (False). Same bits either way; benchmarks flip it to measure both.
ROW_LOOP = True


@triton.jit
def _gemv_row(m, pid, x_ptr, r_ptr, nw_ptr, w_ptr, b_ptr, y_ptr, rout_ptr, nout_ptr, n_out, eps,
              K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NORM: tl.constexpr,
              NORM_OUT: tl.constexpr, GLU: tl.constexpr, HAS_BIAS: tl.constexpr, PDL: tl.constexpr,
              W_EVICT: tl.constexpr):
    """Output rows [pid * BLOCK_N, ...) of input row m: the one body both launch shapes run, so a row's
    bits are the same whichever runs it (the cache hint W_EVICT changes no arithmetic)."""
    x_ptr += m * K
    r_ptr += m * K
    rout_ptr += m * K
    nout_ptr += m * K
    y_ptr += m * n_out
    rows = (pid * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    row_ok = rows < n_out
    rows = tl.where(row_ok, rows, 0)  # out-of-range rows re-read row 0 and are not stored
    cols = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    acc_up = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)  # GLU only: the matching up rows
    ss = tl.zeros([BLOCK_K], tl.float32)  # NORM only: sum of squares of x + residual
    # the first weight tile does not depend on the previous kernel: under PDL (pdl.py) it is in flight
    # while that kernel finishes
    w_first = tl.load(w_ptr + rows[:, None] * K + cols[None, :], mask=(cols < K)[None, :], other=0.0,
                      eviction_policy=W_EVICT)
    if GLU:
        w_up_first = tl.load(w_ptr + (rows + n_out)[:, None] * K + cols[None, :], mask=(cols < K)[None, :],
                             other=0.0, eviction_policy=W_EVICT)
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    for k0 in tl.static_range(0, K, BLOCK_K):
        c = k0 + cols
        m = c < K
        if k0 == 0:
            w = w_first
            if GLU:
                w_up = w_up_first
        else:
            w = tl.load(w_ptr + rows[:, None] * K + c[None, :], mask=m[None, :], other=0.0,
                        eviction_policy=W_EVICT)
            if GLU:
                w_up = tl.load(w_ptr + (rows + n_out)[:, None] * K + c[None, :], mask=m[None, :], other=0.0,
                               eviction_policy=W_EVICT)
        xv = tl.load(x_ptr + c, mask=m, other=0.0)
        if NORM:
            h = xv + tl.load(r_ptr + c, mask=m, other=0.0)
            if pid == 0:
                tl.store(rout_ptr + c, h, mask=m)
            hf = h.to(tl.float32)
            ss += hf * hf
            xf = hf * tl.load(nw_ptr + c, mask=m, other=0.0).to(tl.float32)
        else:
            xf = xv.to(tl.float32)
        acc += w.to(tl.float32) * xf[None, :]
        if GLU:
            acc_up += w_up.to(tl.float32) * xf[None, :]
    y = tl.sum(acc, axis=1)
    up = tl.sum(acc_up, axis=1)
    if NORM:
        rstd = tl.rsqrt(tl.sum(ss, axis=0) / K + eps)
        y = y * rstd
        up = up * rstd
        if NORM_OUT:  # program 0 also writes the normed input, rounded as the add_rmsnorm kernel rounds it
            if pid == 0:
                for k0 in tl.static_range(0, K, BLOCK_K):
                    c = k0 + cols
                    km = c < K
                    h = tl.load(x_ptr + c, mask=km, other=0.0) + tl.load(r_ptr + c, mask=km, other=0.0)
                    nw = tl.load(nw_ptr + c, mask=km, other=0.0)
                    tl.store(nout_ptr + c, (h.to(tl.float32) * rstd).to(h.dtype) * nw, mask=km)
    if HAS_BIAS:
        y += tl.load(b_ptr + rows).to(tl.float32)
        if GLU:
            up += tl.load(b_ptr + n_out + rows).to(tl.float32)
    out_ty = y_ptr.dtype.element_ty
    if GLU:  # round like the projection output, then like the SiLU*mul kernel
        g = y.to(out_ty).to(tl.float32)
        y = (g / (1.0 + tl.exp(-g))).to(out_ty) * up.to(out_ty)
    tl.store(y_ptr + rows, y.to(out_ty), mask=row_ok)


@triton.jit
def gemv_kernel(x_ptr, r_ptr, nw_ptr, w_ptr, b_ptr, y_ptr, rout_ptr, nout_ptr, n_out, eps,
                K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NORM: tl.constexpr,
                NORM_OUT: tl.constexpr, GLU: tl.constexpr, HAS_BIAS: tl.constexpr, PDL: tl.constexpr):
    """One program per (output tile, input row): the batch-1 decode shape."""
    _gemv_row(tl.program_id(1).to(tl.int64), tl.program_id(0), x_ptr, r_ptr, nw_ptr, w_ptr, b_ptr, y_ptr,
              rout_ptr, nout_ptr, n_out, eps, K, BLOCK_N, BLOCK_K, NORM, NORM_OUT, GLU, HAS_BIAS, PDL, "evict_first")


@triton.jit
def gemv_rows_kernel(x_ptr, r_ptr, nw_ptr, w_ptr, b_ptr, y_ptr, rout_ptr, nout_ptr, n_out, eps,
                     N_ROWS: tl.constexpr, K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     NORM: tl.constexpr, NORM_OUT: tl.constexpr, GLU: tl.constexpr, HAS_BIAS: tl.constexpr,
                     PDL: tl.constexpr):
    """One program per output tile, walking every input row in turn: the tile comes from DRAM once and
    from the SM's cache for the later rows (a verify step's 1 + k rows), where one program per row
    fetches it once per row."""
    pid = tl.program_id(0)
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    for m in tl.range(0, N_ROWS):  # a loop, not unrolled
        _gemv_row(m, pid, x_ptr, r_ptr, nw_ptr, w_ptr, b_ptr, y_ptr, rout_ptr, nout_ptr, n_out,
                  eps, K, BLOCK_N, BLOCK_K, NORM, NORM_OUT, GLU, HAS_BIAS, False, "evict_last")


def default_config(n: int, k: int, norm: bool = False) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps). Measured on an H200 over the 8B projections (benchmarks/gpu_gemv.py
    --sweep): 2 rows x 2048-wide tiles x 4 warps was best or within ~0.6 us of the best on every
    shape. With the norm folded in, every program also re-reads x, the residual and the norm weight
    from L2, so 4 rows per program amortize that (best for q/k/v and gate/up+SiLU*mul, ~2 us faster
    than 2 rows on gate/up). Narrower inputs keep ~4K weight elements per tile."""
    block_k = min(2048, 1 << (k - 1).bit_length())
    return max(2, min(16, 4096 // block_k)) * (2 if norm else 1), block_k, 4


def gemv_unsupported_reason(x: torch.Tensor, weight: torch.Tensor) -> str | None:
    """Why this GEMV cannot take the call (None: it can). Contiguous fp16/bf16 CUDA inputs of at most
    MAX_ROWS rows."""
    if not x.is_cuda or x.dtype not in (torch.float16, torch.bfloat16) or weight.dtype != x.dtype:
        return "CUDA float16/bfloat16 input and weight of one dtype required"
    if not x.is_contiguous() or x.numel() > MAX_ROWS * x.shape[-1]:
        return f"contiguous input of at most {MAX_ROWS} rows"
    if not weight.is_contiguous() or weight.shape[1] > MAX_K:
        return f"contiguous weight with at most {MAX_K} input features"
    return None


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
         residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None, eps: float = 0.0,
         glu: bool = False, normed_out: bool = False, config: tuple[int, int, int] | None = None):
    """y = weight @ x + bias for each row of a contiguous x, keeping x's leading shape. Every row is
    computed exactly as it would be alone (same tiles, same summation order): the result of a row does
    not depend on how many rows the call has. With norm_weight and residual: x is replaced by
    RMSNorm(x + residual) * norm_weight and the call returns (y, x + residual); with normed_out also that
    normed input, as the add_rmsnorm kernel would give it (for a layer that needs it besides this projection:
    the MoE router's experts). With glu: weight is [gate | up] (2I rows) and y = SiLU(gate) * up (I entries)."""
    n, k = weight.shape
    norm = norm_weight is not None
    if normed_out and (not norm or glu):
        raise ValueError("normed_out needs norm_weight and residual, and no glu")
    block_n, block_k, warps = config or default_config(n, k, norm)
    n_out = n // 2 if glu else n
    if glu:
        block_n = max(1, block_n // 2)  # each program reads as many rows: half gate, half up
    y = torch.empty(*x.shape[:-1], n_out, dtype=x.dtype, device=x.device)
    if norm:
        residual = residual.contiguous()
    rout = torch.empty_like(x) if norm else y
    nout = torch.empty_like(x) if normed_out else rout
    rows = x.numel() // k
    args = (x, residual if norm else x, norm_weight if norm else x, weight, bias if bias is not None else weight,
            y, rout, nout, n_out, eps)
    meta = dict(K=k, BLOCK_N=block_n, BLOCK_K=block_k, NORM=norm, NORM_OUT=normed_out, GLU=glu,
                HAS_BIAS=bias is not None, num_warps=warps, **pdl.options(x.device))
    if rows > 1 and ROW_LOOP:
        gemv_rows_kernel[(-(-n_out // block_n),)](*args, N_ROWS=rows, **meta)
    else:
        gemv_kernel[(-(-n_out // block_n), rows)](*args, **meta)
    if normed_out:
        return y, rout, nout
    return (y, rout) if norm else y
