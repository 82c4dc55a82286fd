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

from onecat.engine.quant.packed_shard import note_full_weight

STD = 0.02


@torch.no_grad()
def fill_random_weights(model: torch.nn.Module, seed: int) -> None:
    """A tensor-parallel shard (its layers record their share of the full weight, engine/parallel/sharding.py)
    draws the full matrix and keeps its share, so every rank holds a slice of the same model."""
    for name, p in model.named_parameters():
        if not p.is_floating_point():
            continue
        if p.dim() == 1:
            p.fill_(0.0 if name.endswith("bias") else 1.0)
            continue
        owner = model.get_submodule(name.rpartition(".")[0])
        full = getattr(owner, "_tp_full", None) or tuple(p.shape)
        g = torch.Generator(device=p.device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        w = torch.randn(full, generator=g, device=p.device, dtype=torch.float32).mul_(STD)
        rows, cols = getattr(owner, "_tp_rows", None), getattr(owner, "_tp_cols", None)
        if w.dim() == 2 and (rows is not None or cols is not None):  # for quantization at load of the share
            note_full_weight(owner, w.to(p.dtype), 0)
        if rows is not None:
            w = w.index_select(0, rows.to(p.device))
        if cols is not None:
            w = w.index_select(1, cols.to(p.device))
        p.copy_(w)
