"""oneDNN matmul on weights reordered once into its blocked layout (CPU, float32 or bfloat16).

F.linear hands oneDNN a row-major weight and it reorders it on every call; holding the blocked copy
saves that (at 16 rows ~40% of a bfloat16 GEMM on a 2-core AVX512-BF16 CPU), and the blocked kernel
walks K in one fixed order whatever the row count (engine/layers/batch_invariant_linear.py relies on it).
"""
from __future__ import annotations

import functools

import torch

_matmul = torch.ops.mkldnn._linear_pointwise.default


def available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


@functools.cache
def bf16_available() -> bool:
    """Whether this CPU's oneDNN takes a bfloat16 linear: it refuses one without AVX512BW/VL/DQ or AVX-NE-CONVERT
    (an AVX2-only CPU), and callers then keep the plain GEMM."""
    if not available():
        return False
    try:
        onednn_blocked(torch.zeros(16, 16, dtype=torch.bfloat16))
    except RuntimeError:
        return False
    return True


def onednn_blocked(weight: torch.Tensor) -> torch.Tensor:
    """The [N, K] weight reordered into oneDNN's blocked layout, for onednn_matmul (any row count)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


def onednn_matmul(rows: torch.Tensor, blocked: torch.Tensor) -> torch.Tensor:
    """rows [M, K] times the blocked weight's transpose -> [M, N], no bias."""
    return _matmul(rows, blocked, None, "none", [None], "")


def row_count_invariant(blocked: torch.Tensor, in_features: int, rows: int, block: int) -> bool:
    """Whether one call of `rows` bfloat16 rows gives every row the same bits as calls of `block` rows.

    oneDNN picks its kernel by the row count; on some CPUs (with AMX, small row counts) the kernels sum K in
    other orders, on others (AVX512-BF16 without AMX) every count gives the same bits. Checked on random rows:
    another summation order moves an fp32 sum by a unit or so in its last place, which changes the bf16
    output where the sum sits near a rounding boundary (measured: ~2e-4 of the outputs at K = 512-1536), so
    `rows` x N outputs (N >= 576 for the embedded model: dozens of such cases) tell the kernels apart, and a
    caller takes large calls only where they do not change a result."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, in_features, generator=g).to(torch.bfloat16)
    parts = torch.cat([onednn_matmul(x[r:r + block], blocked) for r in range(0, rows, block)])
    return torch.equal(onednn_matmul(x, blocked), parts)
