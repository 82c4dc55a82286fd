"""SwiGLU feed-forward with the gate and up projections fused into one matmul."""
import torch
import torch.nn.functional as F
from torch import nn

from onecat.engine.layers.linear import Linear, glu_in_gemv, norm_then_linear


class GatedMLP(nn.Module):
    use_fused = False  # the engine turns this on per model (CUDA + Triton): one SiLU*mul kernel
    cpu_ops = None  # the fused CPU ops (engine/kernels/cpu_ops.py), when the engine turns them on

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.intermediate = intermediate
        self.gate_up_proj = Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        act = glu_in_gemv(self.gate_up_proj, x, self.use_fused)
        return self.down_proj(act if act is not None else self._silu_mul(self.gate_up_proj(x)))

    def after_norm(self, norm, x: torch.Tensor, residual: torch.Tensor):
        """(self(norm(x + residual)), x + residual); at one token on CUDA the add, the norm, the gate/up
        projection and SiLU*mul are one GEMV kernel."""
        act, residual = norm_then_linear(norm, self.gate_up_proj, x, residual, silu_mul=self._silu_mul)
        return self.down_proj(act), residual

    def _silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.use_fused and gate_up.is_cuda:
            from onecat.engine.kernels.triton_fused import silu_mul

            return silu_mul(gate_up)
        if self.cpu_ops is not None and not gate_up.is_cuda and gate_up.dim() == 2 and \
                gate_up.dtype in (torch.float32, torch.bfloat16):  # bfloat16: a packed gate_up's output
            bf16 = getattr(self.down_proj, "input_dtype", None) == torch.bfloat16  # a packed down projection
            return self.cpu_ops.silu_mul(gate_up, bf16)
        gate, up = gate_up.split(self.intermediate, dim=-1)
        return F.silu(gate) * up
