"""NVIDIA ModelOpt unified HF checkpoints (`quant_method: modelopt`, or hf_quant_config.json): NVFP4 and FP8.

NVFP4 (quant_algo "NVFP4"), per linear (N = out_features, K = in_features):
  weight         uint8 [N, K/2]: two FP4 E2M1 codes per byte, element 2i in the low nibble;
  weight_scale   float8_e4m3fn [N, K/16]: one scale per block of 16 inputs;
  weight_scale_2 float32 scalar: the global scale;
  w = e2m1 * (weight_scale * weight_scale_2), the block scale formed in float32 first (as ModelOpt's and
  vLLM's reference dequantizers do), then one exact product with the E2M1 value.
FP8 (quant_algo "FP8"): weight float8_e4m3fn [N, K] and a per-tensor weight_scale: w = weight * scale.
MIXED_PRECISION (e.g. FP8 dense projections and NVFP4 experts): `quantized_layers` names each quantized
linear with its own quant_algo (NVFP4 or FP8, as above); a linear it does not name (the config's
exclude_modules: routers, the LM head, layers left unquantized) is stored dense and loads as it is.
input_scale (activation quantization) and KV-cache scales are not applied: activations stay in the model
dtype (W4A16 / W8A16 emulation, as SM70, which has no FP4 or FP8 tensor cores, runs these models).
"""
from __future__ import annotations

import torch

from onecat.engine.errors import UnsupportedModelError
from onecat.engine.quant.bits import fp4_blocks
from onecat.engine.quant.checkpoint_formats.registry import QuantFormat, register

MODELOPT_ALGOS = ("NVFP4", "FP8")
MIXED = "MIXED_PRECISION"  # per-layer algos, each one of MODELOPT_ALGOS


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
        self.layer_algos: dict[str, str] = {}  # MIXED_PRECISION: module -> its quant_algo
        if self.algo == MIXED:
            layers = inner.get("quantized_layers")
            if not isinstance(layers, dict) or not layers:
                raise UnsupportedModelError("a ModelOpt MIXED_PRECISION config needs quantized_layers (module -> "
                                            "{quant_algo, ...}); this one has none")
            for module, spec in layers.items():
                self.layer_algos[module] = self._checked(str((spec or {}).get("quant_algo") or "").upper(),
                                                         int((spec or {}).get("group_size") or 16), module)
        else:
            self._checked(self.algo, self.group_size, None)

    @staticmethod
    def _checked(algo: str, group_size: int, module: str | None) -> str:
        where = f" for {module}" if module else ""
        if algo not in MODELOPT_ALGOS:
            raise UnsupportedModelError(f"ModelOpt quant_algo {algo!r}{where} is not supported: onecat reads "
                                        f"{', '.join(MODELOPT_ALGOS)} ModelOpt checkpoints (and {MIXED} of them)")
        if algo == "NVFP4" and group_size != 16:
            raise UnsupportedModelError(f"ModelOpt NVFP4 with group_size={group_size}{where} is not supported: "
                                        "NVFP4 blocks are 16 wide")
        return algo

    def describe(self) -> str:
        if self.algo == MIXED:
            return "modelopt mixed " + "/".join(sorted({a.lower() for a in self.layer_algos.values()}))
        return f"modelopt nvfp4 g{self.group_size}" if self.algo == "NVFP4" else "modelopt fp8"

    def layer_algo(self, module: str, weight: torch.Tensor) -> str:
        """NVFP4 or FP8: the algo the config gives `module` (a MIXED_PRECISION layer must be stored as its
        entry says), else the checkpoint's."""
        stored = "FP8" if weight.dtype == torch.float8_e4m3fn else "NVFP4"
        if self.algo != MIXED:
            return stored
        listed = self.layer_algos.get(module)
        if listed is None:
            raise self.bad(module, "it is stored quantized but quantized_layers does not list it")
        if listed != stored:
            raise self.bad(module, f"quantized_layers says {listed} but it is stored as {stored}")
        return listed

    def is_quantized(self, present: dict[str, str]) -> bool:
        return "weight" in present and "weight_scale" in present

    def dequantize(self, module: str, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        weight, scale = self.require(module, tensors, "weight", "weight_scale")
        if self.layer_algo(module, weight) == "FP8":
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
