"""The names `quantization` takes and the checks that refuse a name this model or device cannot run.

"gguf" keeps a GGUF checkpoint's 4-bit blocks packed for the CPU int4 layer (gguf_packer.py); every other name
keeps an HF checkpoint's quantized linears packed, or quantizes a dense one at load (hf_packer.py).
"""
from __future__ import annotations

import torch

from onecat.engine.errors import ConfigError
from onecat.engine.quant.hf_packer import W4A16_NAMES, check_w4a16
from onecat.engine.quant.int4.linear import Int4PackedLinear

QUANTIZATIONS = ("gguf", *W4A16_NAMES)


def check_quantization(quantization: str | None, model_format: str, device: torch.device) -> None:
    if quantization is None:
        return
    if quantization in W4A16_NAMES:
        check_w4a16(quantization, model_format, device)
        return
    if quantization not in QUANTIZATIONS:
        raise ConfigError(f"quantization={quantization!r} is not supported; use one of {', '.join(QUANTIZATIONS)} "
                          "or leave it unset to run the checkpoint dequantized")
    if model_format != "gguf":
        raise ConfigError(f"quantization='gguf' needs a .gguf checkpoint, this model is {model_format!r}; "
                          "leave quantization unset")
    if not Int4PackedLinear.supported(device):
        raise ConfigError(f"quantization='gguf' has a packed 4-bit kernel on CPU only, not on {device}; "
                          "leave quantization unset to run the checkpoint dequantized there")
