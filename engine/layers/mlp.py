"""SwiGLU feed-forward with the gate and up projections fused into one matmul."""
import torch
import torch.nn.functional as F
from torch import nn


class GatedMLP(nn.Module):
    use_fused = False  # the engine turns this on per model (CUDA + Triton): one SiLU*mul kernel

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.intermediate = intermediate
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.use_fused and gate_up.is_cuda:
            from onecat.engine.layers.triton_fused import silu_mul

            return self.down_proj(silu_mul(gate_up))
        gate, up = gate_up.split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)
