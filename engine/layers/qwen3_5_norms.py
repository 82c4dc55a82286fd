"""The two RMSNorms of Qwen3.5 that differ from Llama's: zero-centered (the weight is stored as an offset from
1 and the product is taken in float32 before the cast back) and gated (Gated DeltaNet's output, normed per
head and multiplied by SiLU of a gate)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from onecat.engine.layers import hybrid_kernels
from onecat.engine.layers.pointwise import pointwise


class ZeroCenteredRMSNorm(nn.Module):
    use_fused = False  # the engine turns this on per model (CUDA + Triton); one kernel needs hybrid_kernels too

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def normed(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """RMSNorm(x); with `residual`: (RMSNorm(x + residual), x + residual)."""
        if self.use_fused and hybrid_kernels.ENABLED and x.is_cuda:  # one kernel for the ~10 ops below
            from onecat.engine.kernels.triton_fused import add_rmsnorm

            return add_rmsnorm(x, residual, self.weight, self.eps, zero_centered=True)
        if residual is None:
            return self.normed(x)
        x = x + residual
        return self.normed(x), x


class GatedRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """weight * RMSNorm(x) * SiLU(gate), over the last dim, in x's dtype."""
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * xf.to(x.dtype) * pointwise(F.silu, gate.float())).to(x.dtype)
