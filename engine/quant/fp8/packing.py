"""quantization='fp8': an FP8 (E4M3) checkpoint's linears stay packed for the CUDA packed GEMV (W8A16: the
weight is read as bytes, activations stay in the model dtype, so it runs on SM70, which has no FP8 units).

Read: compressed-tensors `float-quantized` (per-tensor or per-channel weight_scale) and ModelOpt FP8
(per-tensor weight_scale). Block-wise (2-D) scales are not packed: those layers load dense and are listed
in the engine's info, as is any layer whose in_features is not a multiple of 16.
"""
from __future__ import annotations

import torch

from onecat.engine.errors import ConfigError
from onecat.engine.quant.fp8.layout import BLOCK, FP8Weight, pack_fp8

FP8_METHODS = ("compressed-tensors", "modelopt")


def fp8_convert(fmt, module: str, stored: dict[str, torch.Tensor]) -> FP8Weight | None:
    """The packed FP8 weight of one stored linear; None where it stays dense (block scales, in_features not a
    multiple of 16); a checkpoint that is not FP8 is refused with what to use."""
    weight = stored.get("weight")
    if fmt.method not in FP8_METHODS or weight is None or weight.dtype != torch.float8_e4m3fn:
        raise ConfigError(f"quantization='fp8' reads FP8 E4M3 checkpoints (compressed-tensors float-quantized, "
                          f"ModelOpt FP8); {module} of this {fmt.describe()} checkpoint is not one: leave "
                          "quantization unset to run it dequantized")
    (scale,) = fmt.require(module, stored, "weight_scale")
    n, k = weight.shape
    if scale.numel() not in (1, n) or k % BLOCK:
        return None
    return pack_fp8(weight, scale)


def cat_fp8(shards: list[FP8Weight]) -> FP8Weight | None:
    """Fused shards stacked along N (each keeps its own row scales)."""
    if any(s.in_features != shards[0].in_features for s in shards):
        return None
    return FP8Weight(torch.cat([s.qweight for s in shards]), torch.cat([s.scale for s in shards]))
