"""Shared by the GPU kernel tests: skip where the fused Triton kernels cannot run, and the tolerance
a half-precision kernel result is held to against its reference."""
from __future__ import annotations

import pytest
import torch


def require_fused_kernels() -> None:
    from onecat.engine.kernels.triton_support import fused_unavailable_reason

    reason = fused_unavailable_reason()
    if reason:
        pytest.skip(reason)


def half_tolerance(dtype: torch.dtype) -> float:
    return 2e-2 if dtype == torch.bfloat16 else 4e-3
