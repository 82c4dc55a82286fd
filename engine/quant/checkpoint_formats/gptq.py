"""GPTQ (AutoGPTQ / GPTQModel, `quant_method: gptq`): 2-, 4- or 8-bit weights with a zero and a scale per
group of input rows, groups possibly in activation order.

Stored per linear (K = in_features, N = out_features, b = bits, G = group size, -1 meaning all of K):
  qweight int32 [K*b/32, N]: packed along K, row 32/b*i + j of the weight in field j of word row i;
  qzeros  int32 [K/G, N*b/32]: packed along N the same way. The classic format ("gptq", v1) stores
      zero - 1 (so a symmetric 4-bit checkpoint stores 7 for the zero 8); "gptq_v2" stores the zero;
  scales  fp16  [K/G, N];
  g_idx   int32 [K] (optional): the group of each input row. With desc_act the quantizer visited rows
      by activation order, so a group's rows are scattered; the rows themselves stay in model order.
w[n, k] = (q[k, n] - z[g_idx[k], n]) * s[g_idx[k], n], exact in float32 (an integer times an fp16 scale).
The v1 zero is read as field + 1 without wrapping, as GPTQ's own kernels do.
"""
from __future__ import annotations

import torch

from onecat.engine.errors import UnsupportedModelError
from onecat.engine.quant.bits import by_group, unpack_int32
from onecat.engine.quant.checkpoint_formats.registry import QuantFormat, register

GPTQ_BITS = (2, 4, 8)
GPTQ_LAYOUTS = ("gptq", "gptq_v2")


@register("gptq")
class GPTQ(QuantFormat):
    method = "gptq"
    parts = ("qweight", "qzeros", "scales", "g_idx")

    def __init__(self, config: dict) -> None:
        super().__init__(config)
        self.bits = int(config.get("bits", 4))
        self.group_size = int(config.get("group_size", 128))
        self.desc_act = bool(config.get("desc_act", False))
        layout = "marlin" if config.get("is_marlin_format") else (
            config.get("checkpoint_format") or config.get("format") or "gptq")
        self.layout = str(layout).lower()
        if self.layout not in GPTQ_LAYOUTS:
            raise UnsupportedModelError(
                f"GPTQ checkpoint_format {self.layout!r} is not supported: onecat reads {' and '.join(GPTQ_LAYOUTS)} "
                "(GPTQModel can convert other layouts back to 'gptq')")
        if self.bits not in GPTQ_BITS:
            raise UnsupportedModelError(f"GPTQ with bits={self.bits} is not supported: onecat reads "
                                        f"{', '.join(map(str, GPTQ_BITS))}-bit GPTQ")

    def describe(self) -> str:
        group = "per-channel" if self.group_size <= 0 else f"g{self.group_size}"
        extra = (" act-order" if self.desc_act else "") + (" v2" if self.layout == "gptq_v2" else "")
        return f"gptq w{self.bits} {group}{extra}"

    def dequantize(self, module: str, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        qweight, qzeros, scales = self.require(module, tensors, "qweight", "qzeros", "scales")
        per = 32 // self.bits
        k, n = qweight.shape[0] * per, qweight.shape[1]
        groups = scales.shape[0]
        if (qweight.dtype != torch.int32 or scales.shape != (groups, n) or qzeros.shape != (groups, n // per)
                or groups == 0):
            raise self.bad(module, f"qweight {tuple(qweight.shape)} {qweight.dtype}, qzeros {tuple(qzeros.shape)}, "
                                   f"scales {tuple(scales.shape)} are not {self.bits}-bit GPTQ's [K*b/32, N], "
                                   "[K/G, N*b/32], [K/G, N]")
        g_idx = tensors.get("g_idx")
        if g_idx is not None:
            if g_idx.shape != (k,) or int(g_idx.min()) < 0 or int(g_idx.max()) >= groups:
                raise self.bad(module, f"g_idx {tuple(g_idx.shape)} must give each of the {k} input rows a group "
                                       f"in [0, {groups})")
        elif k % groups:
            raise self.bad(module, f"{groups} scale groups do not divide {k} input rows and there is no g_idx")
        q = unpack_int32(qweight, self.bits, dim=0)
        z = unpack_int32(qzeros, self.bits, dim=1) + (1 if self.layout == "gptq" else 0)
        z = by_group(z, k, dim=0, g_idx=g_idx)
        s = by_group(scales.float(), k, dim=0, g_idx=g_idx)
        return ((q - z).float() * s).t().contiguous()
