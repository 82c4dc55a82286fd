"""Transcendental elementwise functions (exp, sigmoid, softplus, SiLU) whose result for an element does not
depend on how many elements the tensor holds.

ATen's CPU elementwise kernels run the bulk of a contiguous tensor through the vectorized implementation
(SLEEF) and the last few elements, those short of a full pair of vectors, through the scalar one, and the
two differ in the last bits. So a token's activations changed with the number of tokens in the step (a
[T, heads] tensor of decays is all tail at T = 1). Through a view with an inner stride of 2 the kernel
takes its scalar loop for every element: each element's result is then a function of that element alone.
Used on CPU for the per-token gates and decays of the MoE and hybrid layers; elsewhere the op runs as is.
"""
from __future__ import annotations

from collections.abc import Callable

import torch


def pointwise(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """fn(x), element by element with the scalar kernel on CPU."""
    if x.device.type != "cpu" or x.numel() == 0:
        return fn(x)
    strided = torch.empty(*x.shape, 2, dtype=x.dtype, device=x.device)
    strided[..., 0] = x
    return fn(strided[..., 0])
