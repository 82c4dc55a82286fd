"""quantization='nvfp4' / 'mxfp4': what the packer (hf_packer.py) does with an FP4 checkpoint's linears.

Each stored linear is re-packed without changing a value (fp4/layout.py); a layer the FP4 GEMV cannot
take (in_features not a multiple of 64, or MXFP4 scales above 2^101, which its scale decode does not
represent) stays dense and is listed in the engine's info.
"""
from __future__ import annotations

import torch

from onecat.engine.errors import ConfigError
from onecat.engine.quant.fp4.layout import MAX_E8M0, FP4Weight, from_mxfp4, from_nvfp4

FP4_NAMES = {"nvfp4": "modelopt", "mxfp4": "mxfp4"}


def fp4_convert(fmt, module: str, stored: dict[str, torch.Tensor]) -> FP4Weight:
    """The packed FP4 weight of one stored linear (NVFP4 ModelOpt or MXFP4); FP8 ModelOpt is refused."""
    if fmt.method == "modelopt":
        if getattr(fmt, "algo", "") not in ("NVFP4", "MIXED_PRECISION"):  # mixed: its NVFP4 layers come here
            raise ConfigError(f"quantization='nvfp4' but the checkpoint is {fmt.describe()}; leave quantization "
                              "unset to run it dequantized")
        weight, scale, global_scale = fmt.require(module, stored, "weight", "weight_scale", "weight_scale_2")
        try:
            return from_nvfp4(weight, scale, global_scale)
        except ValueError as e:
            raise fmt.bad(module, str(e)) from e
    blocks, scales = fmt.require(module, stored, "weight_blocks", "weight_scales")
    try:
        return from_mxfp4(blocks, scales)
    except ValueError as e:
        raise fmt.bad(module, str(e)) from e


def fp4_unsupported_reason(weight) -> str | None:
    """Why a packed weight cannot run the FP4 GEMV (None: it can, or it is not an FP4 weight)."""
    if not isinstance(weight, FP4Weight):
        return None
    if weight.in_features % 64:
        return f"in_features {weight.in_features} is not a multiple of 64"
    if weight.fmt == "mxfp4" and int(weight.scales.max()) > MAX_E8M0:
        return f"an MXFP4 scale exponent above {MAX_E8M0} (2^{MAX_E8M0 - 127})"
    return None
