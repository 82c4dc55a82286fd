"""A DFlash drafter's linear layers quantized at load (speculative_config `quantization`): every projection of its
layers and its context projection `fc`, round to nearest in FP8 (E4M3, a scale per row), NVFP4, MXFP4 or W4A16
(engine/quant/rtn.py), run by the packed layers the targets use (engine/quant/packed_model.py).

Why: a drafter reads its weights every round, at the target's width (route 1's five bf16 layers of a 27B target
read ~3.4 GB a round, about a fifth of a target step); FP8 halves that, the 4-bit formats quarter it. The
drafts may change (the drafter's products are rounded otherwise), the output never does: the verifier keeps the
target's tokens and law. The stacked projections the drafting path runs in one call (a layer's q/k/v; every
layer's context k/v) are stacked from the quantized rows, whose scales are per row or per group of a row, so the
stack is the rows quantized alone. A projection its format cannot take (K not a multiple of its block) stays
dense and is listed. On the CPU, W4A16 runs in the int4 layer of the CPU's packed targets (int8 dot products where
the CPU has them): a float32 drafter of the embedded target reads 42 MB a round, its W4A16 form ~7 MB.
"""
from __future__ import annotations

import torch
from torch import nn

FORMATS = ("fp8", "nvfp4", "mxfp4", "w4a16")


def _packed(weights: list, biases: list, dtype: torch.dtype, device: torch.device) -> nn.Module | None:
    """One packed layer of the quantized `weights` stacked along N (their biases likewise, or None)."""
    from onecat.engine.quant.packed_model import cat_packed, packed_layer

    if any(w is None for w in weights):
        return None
    stacked = cat_packed(weights)
    if stacked is None:
        return None
    bias = None if biases[0] is None else torch.cat(biases).to(device)
    return packed_layer(stacked, bias, dtype, device, cpu_int4=device.type == "cpu")


def quantize_drafter(drafter: nn.Module, fmt: str) -> dict:
    """Replace the linears of `drafter` (a loaded DFlashDrafter, on its device and dtype) by packed `fmt` layers,
    and give it the stacked packed projections of its drafting path: `qkv_packed` on each attention and
    `kv_packed` (with `kv_packed_norm`, the layers' k_norm weights) on the drafter. Returns what it did."""
    from onecat.engine.quant.rtn import quantize

    if fmt not in FORMATS:
        raise ValueError(f"drafter quantization {fmt!r}: expected one of {', '.join(FORMATS)}")
    dtype, device = drafter.norm.weight.dtype, drafter.norm.weight.device
    kept, packed = [], 0
    quantized: dict[str, object] = {}
    for name, module in list(drafter.named_modules()):
        if not isinstance(module, nn.Linear):
            continue
        weight = quantize(module.weight.data, fmt)
        quantized[name] = weight
        layer = None if weight is None else _packed([weight], [module.bias], dtype, device)
        if layer is None:
            kept.append(name)
            continue
        parent, _, leaf = name.rpartition(".")
        setattr(drafter.get_submodule(parent) if parent else drafter, leaf, layer)
        packed += 1
    kv_weights, kv_biases = [], []
    for i, layer in enumerate(drafter.layers):
        attn, base = layer.self_attn, f"layers.{i}.self_attn."
        parts = [base + p for p in ("q_proj", "k_proj", "v_proj")]
        attn.qkv_packed = _packed([quantized[p] for p in parts], [getattr(attn, p.rpartition(".")[2]).bias
                                                                  for p in parts], dtype, device)
        kv_weights += [quantized[base + "k_proj"], quantized[base + "v_proj"]]
        kv_biases += [attn.k_proj.bias, attn.v_proj.bias]
    drafter.kv_packed = _packed(kv_weights, kv_biases, dtype, device)
    drafter.kv_packed_norm = torch.stack([layer.self_attn.k_norm.weight for layer in drafter.layers])
    return {"format": fmt, "packed_linears": packed, "kept_dense": kept,
            "stacked": {"qkv": all(layer.self_attn.qkv_packed is not None for layer in drafter.layers),
                        "context_kv": drafter.kv_packed is not None}}
