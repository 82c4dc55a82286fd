"""Random weights of a model's shapes (load_format "dummy"), for speed measurements without a checkpoint.

Every matrix is drawn from N(0, 0.02^2) (the usual initializer scale, so activations stay finite through
the layers), every vector that scales (norm weights) is one and every bias zero. Each parameter has its
own generator, seeded from the engine seed and the parameter's name, on the parameter's device: every
tensor-parallel rank draws the same full model and keeps its shard of it. The weights mean nothing; only
the speed of the model that holds them does.

Drawn this way, a deep model's logits are nearly flat: a verify step (several rows a sequence) and a decode
step sum in different orders and part at the first near-tie, so speculation cannot be timed against
target-only on them. `peaked` (load_format dummy_peaked) scales the projections that write the residual stream
(attention o_proj, Gated DeltaNet out_proj, MLP and expert down_proj) by PEAK_SCALE and sets the LM head to the
embedding: every kernel still runs over the same bytes, routers still spread tokens over experts as they would,
but the last hidden state stays close to the token's own embedding, whose logit is then far ahead (~100 against
~7 for the best other token of a Qwen3.5-27B shape; the writers move it by ~0.2).
"""
from __future__ import annotations

import zlib

import torch

from onecat.engine.errors import ConfigError
from onecat.engine.quant.packed_shard import note_full_weight

STD = 0.02
PEAK_SCALE = 1e-4  # peaked: the residual writers' share of the drawn weights
RESIDUAL_WRITERS = ("o_proj.weight", "out_proj.weight", "down_proj.weight", "experts.down_proj")


@torch.no_grad()
def fill_random_weights(model: torch.nn.Module, seed: int, peaked: bool = False) -> None:
    """A tensor-parallel shard (its layers record their share of the full weight, engine/parallel/sharding.py)
    draws the full matrix and keeps its share, so every rank holds a slice of the same model. `peaked`: wide-margin
    next tokens (the module docstring)."""
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
        if peaked and name.endswith(RESIDUAL_WRITERS):
            w.mul_(PEAK_SCALE)
        rows, cols = getattr(owner, "_tp_rows", None), getattr(owner, "_tp_cols", None)
        if w.dim() == 2 and (rows is not None or cols is not None):  # for quantization at load of the share
            note_full_weight(owner, w.to(p.dtype), 0)
        if rows is not None:
            w = w.index_select(0, rows.to(p.device))
        if cols is not None:
            w = w.index_select(1, cols.to(p.device))
        p.copy_(w)
    if peaked:
        _peak(model)


def _peak(model: torch.nn.Module) -> None:
    """The LM head becomes the embedding (the residual writers were scaled as they were drawn)."""
    head, embed = getattr(model.lm_head, "weight", None), model.embed_tokens.weight
    if head is embed:
        return
    if not isinstance(head, torch.Tensor) or head.shape != embed.shape:
        raise ConfigError("load_format dummy_peaked sets the LM head to the embedding, which this model's LM head "
                          f"({type(model.lm_head).__name__}) cannot take; use load_format dummy")
    head.copy_(embed)
