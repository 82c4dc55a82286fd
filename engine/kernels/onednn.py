"""oneDNN matmul on weights reordered once into its blocked layout (CPU, float32 or bfloat16).

F.linear hands oneDNN a row-major weight and it reorders it on every call; holding the blocked copy
saves that (at 16 rows ~40% of a bfloat16 GEMM on a 2-core AVX512-BF16 CPU), and the blocked kernel
walks K in one fixed order whatever the row count (engine/layers/batch_invariant_linear.py relies on it).
"""
from __future__ import annotations

import torch

_matmul = torch.ops.mkldnn._linear_pointwise.default


def available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def onednn_blocked(weight: torch.Tensor) -> torch.Tensor:
    """The [N, K] weight reordered into oneDNN's blocked layout, for onednn_matmul (any row count)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


def onednn_matmul(rows: torch.Tensor, blocked: torch.Tensor) -> torch.Tensor:
    """rows [M, K] times the blocked weight's transpose -> [M, N], no bias."""
    return _matmul(rows, blocked, None, "none", [None], "")
