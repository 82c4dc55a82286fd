"""Stored 4-bit linears for the W4A16 tests: a random weight written as AWQ, GPTQ (symmetric, act-order,
v2) or compressed-tensors pack-quantized (symmetric, asymmetric with packed zero points, per channel,
weight_g_idx) tensors, with the format object whose `dequantize` is the loader's reference.
The AWQ and GPTQ writers are the ones tests/test_quant_formats_awq.py and _gptq.py check the formats with."""
from __future__ import annotations

import torch

from onecat.engine.quant.checkpoint_formats.awq import AWQ
from onecat.engine.quant.checkpoint_formats.compressed_tensors import CompressedTensors
from onecat.engine.quant.checkpoint_formats.gptq import GPTQ
from tests.quant_checkpoints import int32_words

GROUP = 32  # the group size of the AWQ and GPTQ writers
CASES = ("awq", "gptq-sym", "gptq-act-order", "gptq-v2", "ct-sym", "ct-asym", "ct-channel", "ct-g_idx")
MODULE = "model.layers.0.mlp.up_proj"


def pack_along(values: torch.Tensor, dim: int) -> torch.Tensor:
    """4-bit values packed into int32 along `dim`, element 8i + j in bits 4j of word i."""
    v = values.long().movedim(dim, 0)
    acc = torch.zeros((v.shape[0] // 8, *v.shape[1:]), dtype=torch.int64)
    for j in range(8):
        acc |= v[j::8] << (4 * j)
    return int32_words(acc).movedim(0, dim).contiguous()


def ct_quantize(w: torch.Tensor, group: int, sym: bool, g_idx: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """compressed-tensors pack-quantized W4: signed codes stored as q + 8 packed along K, fp16 scales per group
    (of `g_idx` when given), asymmetric zero points packed along N."""
    n, k = w.shape
    gi = (torch.arange(k) // group) if g_idx is None else g_idx.long()
    groups = int(gi.max()) + 1
    cols = [w[:, gi == g] for g in range(groups)]
    if sym:
        scale = torch.stack([c.abs().amax(1) / 7 for c in cols], 1).clamp(min=1e-4).half()
        zero = torch.zeros(n, groups)
    else:
        lo = torch.stack([c.amin(1) for c in cols], 1).clamp(max=0)
        hi = torch.stack([c.amax(1) for c in cols], 1).clamp(min=0)
        scale = ((hi - lo) / 15).clamp(min=1e-4).half()
        zero = (-8 - (lo / scale.float()).round()).clamp(-8, 7)
    s, z = scale.float()[:, gi], zero[:, gi]
    q = (w / s + z).round().clamp(-8, 7)
    out = {"weight_packed": pack_along(q + 8, 1), "weight_shape": torch.tensor([n, k]), "weight_scale": scale}
    if not sym:
        out["weight_zero_point"] = pack_along(zero + 8, 0)
    if g_idx is not None:
        out["weight_g_idx"] = g_idx.int()
    return out


def ct_config(sym: bool, strategy: str = "group", group: int = GROUP) -> dict:
    weights = {"num_bits": 4, "type": "int", "symmetric": sym, "strategy": strategy}
    if strategy == "group":
        weights["group_size"] = group
    return {"quant_method": "compressed-tensors", "format": "pack-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}}}


def stored_linear(case: str, weight: torch.Tensor, seed: int = 0):
    """(format, the module's stored tensors) for a [N, K] float32 weight (N a multiple of 8, K of 32)."""
    from tests.test_quant_formats_awq import awq_quantize
    from tests.test_quant_formats_gptq import config as gptq_config
    from tests.test_quant_formats_gptq import gptq_quantize

    if case == "awq":
        return AWQ({"quant_method": "awq", "bits": 4, "group_size": GROUP, "version": "gemm"}), awq_quantize(weight)[0]
    if case.startswith("gptq"):
        sym, act, v2 = case == "gptq-sym", case == "gptq-act-order", case == "gptq-v2"
        extra = {"checkpoint_format": "gptq_v2"} if v2 else {}
        stored = gptq_quantize(weight, 4, sym, act, v2, seed)[0]
        return GPTQ({**gptq_config(4, sym, act), **extra}), stored
    k = weight.shape[1]
    if case == "ct-channel":
        return CompressedTensors(ct_config(True, "channel")), ct_quantize(weight, k, True)
    g_idx = (torch.randperm(k, generator=torch.Generator().manual_seed(seed)) // GROUP).int() \
        if case == "ct-g_idx" else None
    sym = case != "ct-asym"
    return CompressedTensors(ct_config(sym)), ct_quantize(weight, GROUP, sym, g_idx)
