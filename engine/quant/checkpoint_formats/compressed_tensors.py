"""compressed-tensors (llm-compressor's checkpoints, `quant_method: compressed-tensors`).

The config's `config_groups` say which linears (targets: a class name such as "Linear", a module name,
or "re:<regex>") carry which scheme and storage format; `ignore` lists linears stored dense. Read here:
  pack-quantized: weight_packed int32 [N, K*b/32] (b = 2, 4 or 8 bits; element i of a row at bit i*b,
      stored as q + 2**(b-1)), weight_shape [N, K], weight_scale [N, K/G] (group), [N, 1] (channel) or
      one value (tensor), weight_zero_point (asymmetric only; int32 packed along N the same way, or one
      value per scale), weight_g_idx [K] (older checkpoints quantized with actorder
      "group": each input column's group).
      w = (q - zero) * scale: exact in float32 for half-precision scales; with float32 scales it is the
      one correctly rounded float32 product, as the library computes it.
  float-quantized: weight float8_e4m3fn [N, K] and weight_scale per tensor, per output channel, or per
      block (block_structure from the scheme). w = weight * scale: exact in float32 for half-precision
      scales; with float32 scales it is the one correctly rounded float32 product.
  naive-quantized / int-quantized: weight int8 [N, K] with weight_scale (and weight_zero_point).
  nvfp4-pack-quantized: weight_packed uint8 [N, K/2] FP4 E2M1 codes (low nibble first), weight_scale
      float8_e4m3fn [N, K/16], weight_global_scale float32: w = e2m1 * (weight_scale / global_scale).
Activation scales (input_*, output_*, k_scale, v_scale) are dropped: activations stay in the model dtype.
The `compressed-tensors` package is not needed to read these.
"""
from __future__ import annotations

import math
import re

import torch

from onecat.engine.errors import UnsupportedModelError
from onecat.engine.quant.bits import by_group, fp4_blocks, unpack_int32
from onecat.engine.quant.checkpoint_formats.registry import QuantFormat, register

CT_FORMATS = ("pack-quantized", "float-quantized", "naive-quantized", "int-quantized", "nvfp4-pack-quantized",
              "dense")
PACKED_BITS = (2, 4, 8)
FLOAT8 = (torch.float8_e4m3fn, torch.float8_e5m2)


@register("compressed-tensors")
class CompressedTensors(QuantFormat):
    method = "compressed-tensors"
    parts = ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point", "weight_g_idx",
             "weight_global_scale", "weight")
    dropped = ("input_scale", "input_zero_point", "input_global_scale", "output_scale", "output_zero_point",
               "k_scale", "v_scale")

    def __init__(self, config: dict) -> None:
        super().__init__(config)
        self.groups = list((config.get("config_groups") or {}).values())
        self.format = config.get("format") or "dense"
        formats = {self.format} | {g.get("format") for g in self.groups if g.get("format")}
        formats.discard("mixed-precision")
        bad = sorted(f for f in formats if f not in CT_FORMATS)
        if bad:
            raise UnsupportedModelError(f"compressed-tensors format {', '.join(bad)} is not supported: onecat reads "
                                        f"{', '.join(CT_FORMATS)}")
        sparsity = config.get("sparsity_config") or {}
        if sparsity.get("format", "dense") != "dense":
            raise UnsupportedModelError(f"compressed-tensors sparsity format {sparsity['format']!r} is not "
                                        "supported: onecat reads dense (unsparsified) compressed-tensors checkpoints")
        if config.get("transform_config"):
            raise UnsupportedModelError("compressed-tensors checkpoints with a transform_config (rotations) are not "
                                        "supported: their weights need the transforms applied too")
        self.formats = sorted(formats - {"dense"}) or ["dense"]

    def describe(self) -> str:
        weights = [g.get("weights") or {} for g in self.groups]
        kinds = sorted({f"{w.get('type', 'int')}{w.get('num_bits', '')}" + (
            f" g{w['group_size']}" if w.get("group_size") else f" {w.get('strategy', '')}".rstrip())
            for w in weights if w})
        return f"compressed-tensors {'+'.join(self.formats)} {', '.join(kinds)}".rstrip()

    def is_quantized(self, present: dict[str, str]) -> bool:
        return "weight_packed" in present or ("weight" in present and "weight_scale" in present)

    def scheme(self, module: str) -> dict:
        """The first config group whose targets name this linear ({} when none does)."""
        for g in self.groups:
            for t in g.get("targets") or []:
                if (t.startswith("re:") and re.match(t[3:], module)) or module == t or module.endswith("." + t) \
                        or (t[:1].isupper() and "." not in t):
                    return g
        return {}

    def dequantize(self, module: str, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        scheme = self.scheme(module)
        args = scheme.get("weights") or {}
        (scale,) = self.require(module, tensors, "weight_scale")
        if "weight_packed" in tensors and tensors["weight_packed"].dtype == torch.uint8:
            return self._nvfp4(module, tensors)
        if "weight_packed" in tensors:
            packed, shape = self.require(module, tensors, "weight_packed", "weight_shape")
            n, k = (int(x) for x in shape.tolist())
            bits = int(args.get("num_bits") or packed.shape[1] * 32 // k)
            if bits not in PACKED_BITS:
                raise UnsupportedModelError(f"compressed-tensors pack-quantized with num_bits={bits} ({module}) is "
                                            f"not supported: onecat reads {', '.join(map(str, PACKED_BITS))}-bit")
            if packed.dtype != torch.int32 or packed.shape != (n, math.ceil(k * bits / 32)):
                raise self.bad(module, f"weight_packed {tuple(packed.shape)} {packed.dtype} does not hold "
                                       f"[{n}, {k}] {bits}-bit values")
            q = unpack_int32(packed, bits, dim=1)[:, :k] - (1 << (bits - 1))
        else:
            weight = tensors["weight"]
            n, k = weight.shape
            bits = 8
            if weight.dtype not in FLOAT8 + (torch.int8,):
                raise self.bad(module, f"weight is {weight.dtype} next to a weight_scale; expected float8 or int8")
            q = weight
        zero = tensors.get("weight_zero_point")
        if zero is not None and zero.dtype == torch.int32 and zero.shape[0] == math.ceil(n * bits / 32) != n:
            zero = unpack_int32(zero, bits, dim=0)[:n] - (1 << (bits - 1))
        g_idx = tensors.get("weight_g_idx")
        dense = q.float()
        if zero is not None:
            dense = dense - self._expand(module, zero.float(), n, k, args, g_idx)
        return dense * self._expand(module, scale.float(), n, k, args, g_idx)

    def _expand(self, module: str, t: torch.Tensor, n: int, k: int, args: dict, g_idx) -> torch.Tensor:
        """A scale or zero point stored per tensor, channel, group or block, as a tensor broadcastable to [n, k]."""
        if t.numel() == 1:
            return t.reshape(1, 1)
        block = args.get("block_structure")
        if args.get("strategy") == "block" and block:
            bh, bw = block
            if t.shape == (math.ceil(n / bh), math.ceil(k / bw)):
                return t.repeat_interleave(bh, 0).repeat_interleave(bw, 1)[:n, :k]
        if t.dim() == 2 and t.shape[0] == n and (t.shape[1] == 1 or g_idx is not None or k % t.shape[1] == 0):
            if g_idx is not None:
                if g_idx.shape != (k,) or int(g_idx.min()) < 0 or int(g_idx.max()) >= t.shape[1]:
                    raise self.bad(module, f"weight_g_idx {tuple(g_idx.shape)} does not map {k} input columns to "
                                           f"{t.shape[1]} groups")
                return by_group(t, k, dim=1, g_idx=g_idx)
            return by_group(t, k, dim=1)
        raise self.bad(module, f"a scale or zero point of shape {tuple(t.shape)} fits no tensor, channel, group or "
                               f"block layout of a [{n}, {k}] weight")

    def _nvfp4(self, module: str, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        packed, scale, global_scale = self.require(module, tensors, "weight_packed", "weight_scale",
                                                   "weight_global_scale")
        try:
            return fp4_blocks(packed, scale.float() / global_scale.float().reshape(()))
        except ValueError as e:
            raise self.bad(module, str(e)) from None
