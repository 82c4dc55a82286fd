"""RMSNorm computed in fp32 and cast back, as the HF reference does; optionally fused with the
residual add that precedes it (one Triton kernel on CUDA when the engine enables fused kernels)."""
import torch
from torch import nn


class RMSNorm(nn.Module):
    use_fused = False  # the engine turns this on per model (CUDA + Triton)
    cpu_ops = None  # the fused CPU ops (engine/kernels/cpu_ops.py), when the engine turns them on

    def cpu_fused(self, x: torch.Tensor, residual: torch.Tensor | None, bf16_out: bool = False):
        """forward(x, residual) in one fused CPU call (the normed rows in bfloat16 with bf16_out, for a
        packed 4-bit matmul), or None where the call does not apply."""
        if self.cpu_ops is None or x.is_cuda:
            return None
        if residual is None and x.dtype != torch.float32:
            return None
        if residual is not None and (residual.dtype != torch.float32 or x.dtype not in (torch.float32, torch.bfloat16)):
            return None  # a bfloat16 x (a packed matmul's output) adds to the float32 residual exactly
        width = x.shape[-1]
        out, summed = self.cpu_ops.add_rms_norm(x.reshape(-1, width), None if residual is None else
                                                residual.reshape(-1, width), self.weight, self.eps, bf16_out)
        out = out.view(*x.shape[:-1], width)
        return out if residual is None else (out, summed.view(residual.shape))

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """RMSNorm(x); with `residual`: (RMSNorm(x + residual), x + residual)."""
        if self.use_fused and x.is_cuda:
            from onecat.engine.kernels.triton_fused import add_rmsnorm

            return add_rmsnorm(x, residual, self.weight, self.eps)
        fused = self.cpu_fused(x, residual)
        if fused is not None:
            return fused
        if residual is not None:
            x = x + residual
            return self._norm(x), x
        return self._norm(x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        return self.normalize(x, self.weight, self.eps)

    @staticmethod
    def normalize(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """weight * RMSNorm(x) over the last dim, in fp32 and cast back (weight may broadcast: several norms'
        weights stacked along a leading dim)."""
        if x.dtype == torch.float32:  # the same arithmetic, without the casts' calls
            return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True).add_(eps)))
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return weight * xf.to(x.dtype)
