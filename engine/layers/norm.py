"""RMSNorm computed in fp32 and cast back, as the HF reference does; optionally fused with the
residual add that precedes it (one Triton kernel on CUDA when the engine enables fused kernels)."""
import torch
from torch import nn


class RMSNorm(nn.Module):
    use_fused = False  # the engine turns this on per model (CUDA + Triton)

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """RMSNorm(x); with `residual`: (RMSNorm(x + residual), x + residual)."""
        if self.use_fused and x.is_cuda:
            from onecat.engine.kernels.triton_fused import add_rmsnorm

            return add_rmsnorm(x, residual, self.weight, self.eps)
        if residual is not None:
            x = x + residual
            return self._norm(x), x
        return self._norm(x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)
