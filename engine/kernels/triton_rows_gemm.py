"""A few-row GEMM (Triton) for the steps between batch 1 and a prefill: a speculative verify step's 1 + k
rows, a DFlash drafter's 16-row block, a decode step of 2-32 sequences.

Such a call is still bound by reading the weight once, but the library GEMM takes it with split-K kernels
and a reduce kernel, launched without programmatic dependent launch, and every projection needs its own
norm and SiLU*mul kernels around it: a verify step of the Llama-3-8B shape ran ~20% above a batch-1
step, most of it in those gaps. This kernel reads each weight tile once for all rows (tensor-core dot,
fp32 accumulator, no split-K), and folds in the same small ops as the batch-1 GEMV (triton_gemv.py):
  norm   the input is RMSNorm(x + residual) * norm_weight; x + residual is also stored. The statistic
         comes from a first pass over the rows (they are a few KB, read from L2), and the normed input
         is rounded exactly as the add_rmsnorm kernel rounds it before it enters the dot.
  glu    W is a fused [gate | up] projection and the output is SiLU(gate) * up, rounded as the
         projection output and the SiLU*mul kernel would be.
Launched under PDL (pdl.py) where the GPU has it. The tile sizes are a fixed function of the shape, so a
model sums in the same order on every run; a row's result may depend on how many rows share the call (the
dot's instruction shape), as the library GEMM's does.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from onecat.engine.kernels import pdl

MAX_ROWS = 32  # rows of one call: more is a prefill's shape, which the library GEMM serves well
MAX_K = 65536


@triton.jit
def rows_gemm_kernel(x_ptr, r_ptr, nw_ptr, w_ptr, b_ptr, y_ptr, rout_ptr, M, n_out, eps,
                     K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     STAGES: tl.constexpr, NORM: tl.constexpr, GLU: tl.constexpr, HAS_BIAS: tl.constexpr,
                     PDL: tl.constexpr):
    """Output columns [pid * BLOCK_N, ...) of every input row (all M <= BLOCK_M of them)."""
    pid = tl.program_id(0)
    if PDL:  # pdl.py: wait for the previous kernel, then let the next one start
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    m = tl.arange(0, BLOCK_M)
    m_ok = m < M
    n = (pid * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    n_ok = n < n_out
    n = tl.where(n_ok, n, 0)  # out-of-range columns re-read row 0 of W and are not stored
    ks = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + m[:, None] * K
    r_rows = r_ptr + m[:, None] * K
    w_cols = w_ptr + n[None, :] * K  # W is [N, K]: column j of the dot's [K, N] operand is row j of W
    rstd = tl.zeros([BLOCK_M], tl.float32)
    if NORM:  # pass 1: x + residual (stored once, by program 0) and its RMS statistic
        ss = tl.zeros([BLOCK_M], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            c = k0 + ks
            ok = m_ok[:, None] & (c < K)[None, :]
            h = tl.load(x_rows + c[None, :], mask=ok, other=0.0) + tl.load(r_rows + c[None, :], mask=ok, other=0.0)
            if pid == 0:
                tl.store(rout_ptr + m[:, None] * K + c[None, :], h, mask=ok)
            hf = h.to(tl.float32)
            ss += tl.sum(hf * hf, axis=1)
        rstd = tl.rsqrt(ss / K + eps)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)  # GLU only: the matching up columns
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        c = k0 + ks
        k_ok = c < K
        a = tl.load(x_rows + c[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        if NORM:  # rounded as add_rmsnorm rounds it: (h * rstd) cast, then times the norm weight
            a = a + tl.load(r_rows + c[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            nw = tl.load(nw_ptr + c, mask=k_ok, other=0.0)
            a = (a.to(tl.float32) * rstd[:, None]).to(nw.dtype) * nw[None, :]
        w = tl.load(w_cols + c[:, None], mask=k_ok[:, None], other=0.0)
        acc = tl.dot(a, w, acc)
        if GLU:
            w_up = tl.load(w_cols + n_out * K + c[:, None], mask=k_ok[:, None], other=0.0)
            acc_up = tl.dot(a, w_up, acc_up)
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        if GLU:
            acc_up += tl.load(b_ptr + n_out + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out_ty = y_ptr.dtype.element_ty
    y = acc
    if GLU:  # round like the projection output, then like the SiLU*mul kernel
        g = acc.to(out_ty).to(tl.float32)
        y = (g / (1.0 + tl.exp(-g))).to(out_ty) * acc_up.to(out_ty)
    tl.store(y_ptr + m[:, None] * n_out + n[None, :], y.to(out_ty), mask=m_ok[:, None] & n_ok[None, :])


def default_config(rows: int, n_out: int, k: int, glu: bool) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, STAGES, num_warps): 16 or 32 rows; 32 output columns a program (64 where
    that still leaves two programs an SM on an H100-sized GPU), 128-wide K tiles, four in flight."""
    block_m = 16 if rows <= 16 else 32
    block_n = 64 if n_out >= 64 * 264 and not glu else 32
    block_k = min(128, max(16, 1 << (k - 1).bit_length()))
    return block_m, block_n, block_k, 4, 4


def rows_gemm_unsupported_reason(x: torch.Tensor, weight: torch.Tensor) -> str | None:
    """Why this kernel cannot take the call (None: it can): contiguous fp16/bf16 CUDA input and weight of one
    dtype, 2..MAX_ROWS rows, K a multiple of 16 (the dot's K step)."""
    if x.device.type != "cuda" or x.dtype not in (torch.float16, torch.bfloat16) or weight.dtype != x.dtype:
        return "CUDA float16/bfloat16 input and weight of one dtype required"
    k = weight.shape[1]
    rows = x.numel() // max(1, x.shape[-1])
    if not 2 <= rows <= MAX_ROWS:
        return f"2 to {MAX_ROWS} input rows"
    if not (x.is_contiguous() and weight.is_contiguous()) or k % 16 or k > MAX_K:
        return f"contiguous input and weight, input features a multiple of 16 up to {MAX_K}"
    return None


def rows_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
              residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None, eps: float = 0.0,
              glu: bool = False, config: tuple[int, int, int, int, int] | None = None):
    """y = x @ weight.T + bias over the rows of a contiguous x, keeping x's leading shape. With norm_weight and
    residual: x is replaced by RMSNorm(x + residual) * norm_weight and the call returns (y, x + residual). With
    glu: weight is [gate | up] (2I rows) and y = SiLU(gate) * up (I entries). The caller checks
    rows_gemm_unsupported_reason first."""
    n, k = weight.shape
    norm = norm_weight is not None
    n_out = n // 2 if glu else n
    rows = x.numel() // k
    block_m, block_n, block_k, stages, warps = config or default_config(rows, n_out, k, glu)
    y = torch.empty(*x.shape[:-1], n_out, dtype=x.dtype, device=x.device)
    if norm:
        residual = residual.contiguous()
    rout = torch.empty_like(x) if norm else y
    rows_gemm_kernel[(triton.cdiv(n_out, block_n),)](
        x, residual if norm else x, norm_weight if norm else x, weight, bias if bias is not None else weight,
        y, rout, rows, n_out, eps, K=k, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, STAGES=stages,
        NORM=norm, GLU=glu, HAS_BIAS=bias is not None, num_warps=warps, **pdl.options(x.device))
    return (y, rout) if norm else y
