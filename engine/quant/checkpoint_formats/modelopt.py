"""NVIDIA ModelOpt unified HF checkpoints (`quant_method: modelopt`, or hf_quant_config.json): NVFP4 and FP8.

NVFP4 (quant_algo "NVFP4"), per linear (N = out_features, K = in_features):
  weight         uint8 [N, K/2]: two FP4 E2M1 codes per byte, element 2i in the low nibble;
  weight_scale   float8_e4m3fn [N, K/16]: one scale per block of 16 inputs;
  weight_scale_2 float32 scalar: the global scale;
  w = e2m1 * (weight_scale * weight_scale_2), the block scale formed in float32 first (as ModelOpt's and
  vLLM's reference dequantizers do), then one exact product with the E2M1 value.
FP8 (quant_algo "FP8"): weight float8_e4m3fn [N, K] and a per-tensor weight_scale: w = weight * scale.
input_scale (activation quantization) and KV-cache scales are not applied: activations stay in the model
dtype (W4A16 / W8A16 emulation, as SM70, which has no FP4 or FP8 tensor cores, runs these models).
"""
from __future__ import annotations

import torch

from onecat.engine.errors import UnsupportedModelError
from onecat.engine.quant.bits import fp4_blocks
from onecat.engine.quant.checkpoint_formats.registry import QuantFormat, register

MODELOPT_ALGOS = ("NVFP4", "FP8")


@register("modelopt")
class ModelOpt(QuantFormat):
    method = "modelopt"
    parts = ("weight_scale", "weight", "weight_scale_2")
    dropped = ("input_scale", "k_scale", "v_scale")

    def __init__(self, config: dict) -> None:
        super().__init__(config)
        inner = config.get("quantization") if isinstance(config.get("quantization"), dict) else config
        self.algo = str(inner.get("quant_algo") or "").upper()
        self.group_size = int(inner.get("group_size") or 16)
        if self.algo not in MODELOPT_ALGOS:
            raise UnsupportedModelError(f"ModelOpt quant_algo {inner.get('quant_algo')!r} is not supported: onecat "
                                        f"reads {', '.join(MODELOPT_ALGOS)} ModelOpt checkpoints")
        if self.algo == "NVFP4" and self.group_size != 16:
            raise UnsupportedModelError(f"ModelOpt NVFP4 with group_size={self.group_size} is not supported: "
                                        "NVFP4 blocks are 16 wide")

    def describe(self) -> str:
        return f"modelopt nvfp4 g{self.group_size}" if self.algo == "NVFP4" else "modelopt fp8"

    def is_quantized(self, present: dict[str, str]) -> bool:
        return "weight" in present and "weight_scale" in present

    def dequantize(self, module: str, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        weight, scale = self.require(module, tensors, "weight", "weight_scale")
        if weight.dtype == torch.float8_e4m3fn:
            if scale.numel() != 1:
                raise self.bad(module, f"FP8 weight_scale has {scale.numel()} values; expected one per tensor")
            return weight.float() * scale.float().reshape(())
        (global_scale,) = self.require(module, tensors, "weight_scale_2")
        if weight.dtype != torch.uint8 or scale.dtype != torch.float8_e4m3fn or global_scale.numel() != 1:
            raise self.bad(module, f"weight {weight.dtype}, weight_scale {scale.dtype}, weight_scale_2 with "
                                   f"{global_scale.numel()} values are not NVFP4's uint8, float8_e4m3fn, one float32")
        if scale.shape != (weight.shape[0], weight.shape[1] * 2 // self.group_size):
            raise self.bad(module, f"weight_scale {tuple(scale.shape)} is not one scale per {self.group_size} "
                                   f"inputs of a [{weight.shape[0]}, {weight.shape[1] * 2}] weight")
        return fp4_blocks(weight, scale.float() * global_scale.float().reshape(()))
