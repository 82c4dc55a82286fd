"""A fused projection whose checkpoint shards were stored partly packed and partly dense (a checkpoint that
leaves some of q/k/v, or the Gated DeltaNet's beta/decay rows, unquantized; or rows kept dense on purpose when a
dense checkpoint is quantized at load): each run of rows keeps its own layer, packed or dense, and the outputs
are put side by side. The shards stay as stored instead of the whole fused projection going dense."""
from __future__ import annotations

import torch
from torch import nn


class RowSplitLinear(nn.Module):
    """y = [part_0(x) | part_1(x) | ...]: the parts' out_features add up to this layer's, in row order."""

    def __init__(self, parts: list[nn.Module]) -> None:
        super().__init__()
        if len(parts) < 2:
            raise ValueError("RowSplitLinear needs two or more parts; a single layer runs on its own")
        ins = {p.in_features for p in parts}
        if len(ins) != 1:
            raise ValueError(f"RowSplitLinear parts take different input features {sorted(ins)}")
        self.parts = nn.ModuleList(parts)
        self.in_features = ins.pop()
        self.out_features = sum(p.out_features for p in parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outs = [p(x) for p in self.parts]
        dtype = outs[0].dtype
        return torch.cat([o.to(dtype) for o in outs], dim=-1)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, rows " + " | ".join(
            str(p.out_features) for p in self.parts)
