"""The names `quantization` takes and the check that refuses a name this checkpoint or device cannot run: the
weights stage of the support matrix (engine/support_matrix), asked before the checkpoint is read.

"gguf" keeps a GGUF checkpoint's 4-bit blocks packed for the CPU int4 layer (gguf_packer.py); every other name
keeps an HF checkpoint's quantized linears packed, or quantizes a dense one at load (hf_packer.py).
"""
from __future__ import annotations

import torch

from onecat.engine.quant.hf_packer import W4A16_NAMES, check_w4a16
from onecat.engine.quant.int4.linear import Int4PackedLinear
from onecat.engine.support_matrix import QUANTIZATIONS, Combination, refuse

__all__ = ["QUANTIZATIONS", "check_quantization"]


def check_quantization(quantization: str | None, model_format: str, device: torch.device) -> None:
    """Raises ConfigError with the support matrix's message when `quantization` cannot run this checkpoint
    format ("hf" | "gguf") on `device`."""
    if quantization is None:
        return
    if quantization in W4A16_NAMES:
        check_w4a16(quantization, model_format, device)
        return
    refuse(Combination(quantization=quantization, checkpoint=model_format, device=device.type,
                       packed_cpu_kernel=Int4PackedLinear.supported(torch.device("cpu"))), "settings", "weights")
