"""Skinny GEMM (Triton) for 2-16 rows: y = W x for every row, each weight tile read once for all rows.

A batch-1 speculative verify step (1 + k rows) or a decode step of a few sequences is still a weight
stream: the library GEMM reads the weights once too, but the residual add + RMSNorm before a projection and
the SiLU*mul after the gate/up one stay separate kernels, and its small-M kernels are tuned for larger
shapes. Here every program owns BLOCK_N output features and walks K in BLOCK_K tiles, multiplying the
tile by all rows at once on the tensor cores (the rows padded to 16); the norm and the SiLU*mul fold in
as in the batch-1 GEMV (triton_gemv.py):
  norm   a first pass over the rows' inputs (tiny: rows x K) gathers each row's RMS statistic and stores
         x + residual; the main pass multiplies RMSNorm(x + residual) * norm_weight, rounded to the
         activation dtype as the add_rmsnorm kernel rounds it.
  glu    W is [gate | up]: each program computes gate features n and up features n + I and writes
         SiLU(gate) * up, rounded as the projection output and the activation would be.
A row's result depends on the other rows of the call only through the tile shapes, not their values, but
the summation order is not the batch-1 GEMV's: rows through this kernel agree with it to rounding, not bit
for bit (the exact batch-1 verification, speculative `exact_batch1`, keeps the GEMV).
`ENABLED` is off until the kernel is measured against the library GEMM on a GPU (benchmarks/gpu_gemv.py
--rows); the engine takes it only where it is on.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

ENABLED = False  # the switch benchmarks flip; Linear and norm_then_linear route 2..MAX_ROWS rows here when on
MIN_ROWS, MAX_ROWS = 2, 16
MAX_K = 32768


@triton.jit
def skinny_kernel(x_ptr, r_ptr, nw_ptr, w_ptr, b_ptr, y_ptr, rout_ptr, M, n_out, eps,
                  K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  NORM: tl.constexpr, GLU: tl.constexpr, HAS_BIAS: tl.constexpr):
    pid = tl.program_id(0)
    m = tl.arange(0, BLOCK_M)
    m_ok = m < M
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < n_out
    n = tl.where(n_ok, n, 0)  # out-of-range features re-read feature 0 and are not stored
    act_ty = x_ptr.dtype.element_ty
    rstd = tl.zeros([BLOCK_M], tl.float32)
    if NORM:  # pass 1: each row's sum of squares of x + residual (and x + residual itself, by program 0)
        ss = tl.zeros([BLOCK_M], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            mask = m_ok[:, None] & (k < K)[None, :]
            at = m[:, None] * K + k[None, :]
            h = tl.load(x_ptr + at, mask=mask, other=0.0) + tl.load(r_ptr + at, mask=mask, other=0.0)
            if pid == 0:
                tl.store(rout_ptr + at, h, mask=mask)
            hf = h.to(tl.float32)
            ss += tl.sum(hf * hf, axis=1)
        rstd = tl.rsqrt(ss / K + eps)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)  # GLU only
    for k0 in range(0, K, BLOCK_K):  # pass 2: the weight stream
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        mask = m_ok[:, None] & k_ok[None, :]
        at = m[:, None] * K + k[None, :]
        a = tl.load(x_ptr + at, mask=mask, other=0.0)
        if NORM:  # RMSNorm(x + residual) * weight, rounded as the add_rmsnorm kernel rounds it
            h = a + tl.load(r_ptr + at, mask=mask, other=0.0)
            a = (h.to(tl.float32) * rstd[:, None]).to(act_ty) * tl.load(nw_ptr + k, mask=k_ok, other=0.0)[None, :]
        w = tl.load(w_ptr + n[None, :] * K + k[:, None], mask=k_ok[:, None], other=0.0)  # [BLOCK_K, BLOCK_N]
        acc = tl.dot(a, w, acc)
        if GLU:
            w_up = tl.load(w_ptr + (n + n_out)[None, :] * K + k[:, None], mask=k_ok[:, None], other=0.0)
            acc_up = tl.dot(a, w_up, acc_up)
    if HAS_BIAS:
        acc += tl.load(b_ptr + n).to(tl.float32)[None, :]
        if GLU:
            acc_up += tl.load(b_ptr + n_out + n).to(tl.float32)[None, :]
    out_ty = y_ptr.dtype.element_ty
    y = acc
    if GLU:  # round like the projection output, then like the SiLU*mul kernel
        g = acc.to(out_ty).to(tl.float32)
        y = (g / (1.0 + tl.exp(-g))).to(out_ty) * acc_up.to(out_ty)
    tl.store(y_ptr + m[:, None] * n_out + n[None, :], y.to(out_ty), mask=m_ok[:, None] & n_ok[None, :])


def default_config(n_out: int, k: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps): 16 features a program keeps a few hundred programs busy on the 8B
    projections (6144 / 16 = 384 for q/k/v); 256-wide K tiles. A first guess, to be swept on a GPU."""
    return 16, min(256, max(16, 1 << (k - 1).bit_length())), 4


def skinny_unsupported_reason(x: torch.Tensor, weight: torch.Tensor) -> str | None:
    """Why this kernel cannot take the call (None: it can): MIN_ROWS..MAX_ROWS rows."""
    from onecat.engine.kernels.triton_gemv import operands_unsupported_reason

    return operands_unsupported_reason(x, weight, MIN_ROWS, MAX_ROWS, MAX_K)


def skinny(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
           residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None, eps: float = 0.0,
           glu: bool = False, config: tuple[int, int, int] | None = None):
    """y = weight @ x + bias for each row of x (at most MAX_ROWS rows), keeping x's leading shape. With
    norm_weight and residual: x is replaced by RMSNorm(x + residual) * norm_weight and the call returns
    (y, x + residual). With glu: weight is [gate | up] (2I rows) and y = SiLU(gate) * up (I features)."""
    n, k = weight.shape
    norm = norm_weight is not None
    n_out = n // 2 if glu else n
    block_n, block_k, warps = config or default_config(n_out, k)
    rows = x.numel() // k
    y = torch.empty(*x.shape[:-1], n_out, dtype=x.dtype, device=x.device)
    if norm:
        residual = residual.contiguous()
    rout = torch.empty_like(x) if norm else y
    skinny_kernel[(-(-n_out // block_n),)](
        x, residual if norm else x, norm_weight if norm else x, weight, bias if bias is not None else weight,
        y, rout, rows, n_out, eps, K=k, BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k, NORM=norm, GLU=glu,
        HAS_BIAS=bias is not None, num_warps=warps)
    return (y, rout) if norm else y
