"""A few-row GEMM (Triton) for the steps between batch 1 and a prefill: a speculative verify step's 1 + k
rows, a DFlash drafter's 16-row block, a decode step of 2-32 sequences.

Such a call is still bound by reading the weight once, but the library GEMM takes it with split-K kernels
and a reduce kernel, launched without programmatic dependent launch, and the gate/up projection needs its own
SiLU*mul kernel after it: a verify step of the Llama-3-8B shape ran ~20% above a batch-1 step. This kernel
reads each weight tile once for all rows (tensor-core dot, fp32 accumulator, no split-K), can fold in
SiLU*mul (glu: W is a fused [gate | up] projection, the output SiLU(gate) * up, rounded as the projection
output and the SiLU*mul kernel would be) and is launched under PDL (pdl.py) where the GPU has it. The norm
before a projection stays the add_rmsnorm kernel: folded in, its statistic needs a pass over the rows
before the first product, which cost more than the separate kernel (q/k/v at 8 rows on an H200: 42 against
18 us). The tile sizes are a fixed function of the shape, so a model sums in the same order on every run; a
row's result may depend on how many rows share the call (the dot's instruction shape), as the library GEMM's
does.

Measured on an H100 (benchmarks/results/gpu_rows_gemm_h100.json, speculative_gpu_rounds_h100_rows_gemm_ab.json):
per projection at 8-16 rows it is level with cuBLAS (q/k/v with the norm kernel 22.1 against 23.3 us, o 14.2
against 14.4, gate/up with SiLU*mul 86 against 91 at 2 rows) but every shape stays 10-20% above the batch-1
GEMV, and the 8B verify rounds gained nothing (n-gram-shaped within noise, DFlash-shaped 2% slower): so it is
off unless ONECAT_ROWS_GEMM=1 (engine/layers/linear.py).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from onecat.engine.kernels import pdl

MAX_ROWS = 32  # rows of one call: more is a prefill's shape, which the library GEMM serves well
MAX_K = 65536


@triton.jit(do_not_specialize=["M"])  # one build for every row count (triton_builds.py says why)
def rows_gemm_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, n_out, K: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr, SWAP: tl.constexpr,
                     GLU: tl.constexpr, HAS_BIAS: tl.constexpr, PDL: tl.constexpr):
    """Output columns [pid * BLOCK_N, ...) of every input row (all M <= BLOCK_M of them). SWAP computes the
    transposed product (W tile [BLOCK_N, BLOCK_K] as the dot's first operand, as read from memory, the rows
    second), the layout the library's few-row kernels use."""
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
    if SWAP:
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        acc_up = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)  # GLU only: the matching up rows of W
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        c = k0 + ks
        k_ok = c < K
        if SWAP:
            xt = tl.load(x_ptr + m[None, :] * K + c[:, None], mask=k_ok[:, None] & m_ok[None, :], other=0.0)
            w = tl.load(w_ptr + n[:, None] * K + c[None, :], mask=k_ok[None, :], other=0.0)
            acc = tl.dot(w, xt, acc)
            if GLU:
                w_up = tl.load(w_ptr + (n + n_out)[:, None] * K + c[None, :], mask=k_ok[None, :], other=0.0)
                acc_up = tl.dot(w_up, xt, acc_up)
        else:
            a = tl.load(x_ptr + m[:, None] * K + c[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptr + n[None, :] * K + c[:, None], mask=k_ok[:, None], other=0.0)
            acc = tl.dot(a, w, acc)
            if GLU:
                w_up = tl.load(w_ptr + (n + n_out)[None, :] * K + c[:, None], mask=k_ok[:, None], other=0.0)
                acc_up = tl.dot(a, w_up, acc_up)
    if SWAP:
        acc = tl.trans(acc)
        acc_up = tl.trans(acc_up)
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


def default_config(rows: int, n_out: int, k: int, glu: bool) -> tuple[int, int, int, int, int, bool]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, STAGES, num_warps, SWAP): 16 or 32 rows; 32 output columns a program,
    128-wide K tiles (256 from K = 8192), five in flight."""
    block_m = 16 if rows <= 16 else 32
    return block_m, 32, 256 if k >= 8192 else min(128, max(16, 1 << (k - 1).bit_length())), 5, 4, False


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


def rows_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, glu: bool = False,
              config: tuple[int, int, int, int, int, bool] | None = None) -> torch.Tensor:
    """y = x @ weight.T + bias over the rows of a contiguous x, keeping x's leading shape. With glu: weight is
    [gate | up] (2I rows) and y = SiLU(gate) * up (I entries). The caller checks rows_gemm_unsupported_reason
    first."""
    n, k = weight.shape
    n_out = n // 2 if glu else n
    rows = x.numel() // k
    block_m, block_n, block_k, stages, warps, swap = config or default_config(rows, n_out, k, glu)
    y = torch.empty(*x.shape[:-1], n_out, dtype=x.dtype, device=x.device)
    rows_gemm_kernel[(triton.cdiv(n_out, block_n),)](
        x, weight, bias if bias is not None else weight, y, rows, n_out, K=k, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=block_k, STAGES=stages, SWAP=swap, GLU=glu, HAS_BIAS=bias is not None, num_warps=warps,
        **pdl.options(x.device))
    return y
