"""Random weights of a model's shapes (load_format "dummy"), for speed measurements without a checkpoint.

Every matrix is drawn from N(0, 0.02^2) (the usual initializer scale, so activations stay finite through
the layers), every vector that scales (norm weights) is one and every bias zero. Each parameter has its
own generator, seeded from the engine seed and the parameter's name, on the parameter's device: every
tensor-parallel rank draws the same full model and keeps its shard of it. The weights mean nothing; only
the speed of the model that holds them does.
"""
from __future__ import annotations

import zlib

import torch

STD = 0.02


@torch.no_grad()
def fill_random_weights(model: torch.nn.Module, seed: int) -> None:
    for name, p in model.named_parameters():
        if not p.is_floating_point():
            continue
        if p.dim() == 1:
            p.fill_(0.0 if name.endswith("bias") else 1.0)
            continue
        g = torch.Generator(device=p.device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        p.copy_(torch.randn(p.shape, generator=g, device=p.device, dtype=torch.float32).mul_(STD))
