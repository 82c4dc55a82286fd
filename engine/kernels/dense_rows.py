"""Dense fp16 / bf16 weights through the tensor-core GEMV (csrc/quant_gemv/mma_gemv.cuh, format kDense) for the
calls of 2-16 rows: a verify step's 1 + k rows, a DFlash drafter's block of 16, a small batch.

Why: the library GEMM tiles for many rows; at 8-16 rows it reads the weight well under the copy rate (a DFlash
drafter's 16-row gate/up GEMMs at about half of it, docs/speculative.md) and the gate/up projection needs a
SiLU * mul kernel after it. The GEMV streams each weight once for all rows with its loads in flight while the
previous run is multiplied, folds SiLU * mul into gate/up (the separate kernel's bits), and a row's bits do not
depend on how many rows share the call (each B operand of 8 rows alone, the same splits). One-row calls keep the
batch-1 GEMV (engine/kernels/triton_gemv.py), which also folds the norm before a projection.
"""
from __future__ import annotations

import torch

from onecat.engine.kernels import quant_gemv
from onecat.engine.switches import switch

# 2-16 rows of a dense CUDA layer through the tensor-core GEMV: off until its GPU test and timing (read once;
# benchmarks set it per process)
DENSE_ROWS_GEMV = switch("ONECAT_DENSE_ROWS_GEMV", False)
MIN_ROWS = 2  # one row: the batch-1 GEMV


def unsupported_reason(x: torch.Tensor, weight: torch.Tensor, glu: bool = False) -> str | None:
    """Why the tensor-core GEMV cannot take y = x @ weight^T (None: it can): CUDA, SM80 or newer, the extension
    built, x and weight of one dtype (fp16 or bf16), weight contiguous [N, K] with K a multiple of 128, x of
    1-16 rows in 16-byte aligned memory; glu: [gate | up] halves of a multiple of 16 rows."""
    if not (x.is_cuda and weight.is_cuda):
        return "not a CUDA call"
    if x.dtype not in (torch.float16, torch.bfloat16) or weight.dtype != x.dtype:
        return f"x {x.dtype} and weight {weight.dtype}: both float16 or both bfloat16"
    if weight.dim() != 2 or not weight.is_contiguous() or weight.shape[1] % quant_gemv.MMA_RUN:
        return f"weight {tuple(weight.shape)}: a contiguous [N, K] with K a multiple of {quant_gemv.MMA_RUN}"
    k = weight.shape[1]
    if x.shape[-1] != k or not 1 <= x.numel() // k <= quant_gemv.MMA_MAX_ROWS:
        return f"x {tuple(x.shape)}: 1 to {quant_gemv.MMA_MAX_ROWS} rows of {k} features"
    if glu and weight.shape[0] % 32:
        return f"glu: a [gate | up] weight of a multiple of 32 rows, got {weight.shape[0]}"
    missing = quant_gemv.EXTENSION.unavailable_reason()
    if missing is not None:
        return f"CUDA GEMV unavailable: {missing}"
    if not quant_gemv.tensor_cores_take("dense", x.dtype, x.dtype, 0, k, x.device):
        return "the tensor-core GEMV needs SM80 or newer"
    return None


def takes(x: torch.Tensor, weight: torch.Tensor, glu: bool = False) -> bool:
    """Whether a dense layer's call goes through dense_rows_gemv: DENSE_ROWS_GEMV on, 2-16 rows, and
    unsupported_reason finds nothing."""
    return (DENSE_ROWS_GEMV and x.numel() >= MIN_ROWS * x.shape[-1] > 0
            and unsupported_reason(x, weight, glu) is None)


def dense_rows_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                    glu: bool = False, splits: int = 0) -> torch.Tensor:
    """x @ weight^T (+ bias) for 1-16 rows, leading shape kept; glu: weight is [gate | up] and the result
    SiLU(gate) * up (half the rows; no bias). Raises ValueError with unsupported_reason's text."""
    reason = unsupported_reason(x, weight, glu)
    if reason is not None:
        raise ValueError(f"dense rows GEMV: {reason}")
    if glu and bias is not None:
        raise ValueError("dense rows GEMV: glu with a bias is not folded; run the projection, then SiLU * mul")
    if not x.is_contiguous() or x.data_ptr() % 16:
        x = x.contiguous().clone()
    words = weight.view(torch.int32)
    y = quant_gemv.packed_gemv(x, "dense", words, words, None, 0, splits, glu=glu, kernel="mma")
    return y if bias is None else y + bias
