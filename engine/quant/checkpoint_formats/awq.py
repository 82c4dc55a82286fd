"""AWQ (AutoAWQ / llm-awq, `quant_method: awq`), GEMM layout: 4-bit weights with a zero and a scale per
group of input rows.

Stored per linear (K = in_features, N = out_features, G = group size):
  qweight int32 [K, N/8]: eight output columns per int32, in AWQ's interleaved nibble order: nibble i
      (bits 4i..4i+3) holds column 8c + AWQ_ORDER[i] of word c;
  qzeros  int32 [K/G, N/8]: the zero points, packed the same way (stored as is, no offset);
  scales  fp16  [K/G, N].
w[n, k] = (q[k, n] - z[k/G, n]) * s[k/G, n]. The integer difference times an fp16 scale is exact in
float32, so the dense weight is exact; the only rounding is the one cast to the model dtype.
"""
from __future__ import annotations

import torch

from onecat.engine.errors import UnsupportedModelError
from onecat.engine.quant.bits import by_group, unpack_int32
from onecat.engine.quant.checkpoint_formats.registry import QuantFormat, register

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of a word holds column AWQ_ORDER[i] of its eight
_COLUMN_NIBBLE = [AWQ_ORDER.index(c) for c in range(8)]  # column c sits in nibble _COLUMN_NIBBLE[c]


def awq_columns(packed: torch.Tensor) -> torch.Tensor:
    """[rows, N/8] AWQ-packed int32 -> [rows, N] 4-bit values in column order."""
    nibbles = unpack_int32(packed, 4, dim=1)
    rows, n = nibbles.shape
    return nibbles.view(rows, n // 8, 8)[:, :, _COLUMN_NIBBLE].reshape(rows, n)


@register("awq")
class AWQ(QuantFormat):
    method = "awq"
    parts = ("qweight", "qzeros", "scales")

    def __init__(self, config: dict) -> None:
        super().__init__(config)
        self.bits = int(config.get("bits", config.get("w_bit", 4)))
        self.group_size = int(config.get("group_size", config.get("q_group_size", 128)))
        version = str(config.get("version", "gemm")).lower()
        if version != "gemm":
            raise UnsupportedModelError(
                f"AWQ version {version!r} is not supported: onecat reads AWQ's GEMM layout (version 'gemm', "
                "AutoAWQ's default); export the model with version='gemm'")
        if self.bits != 4:
            raise UnsupportedModelError(f"AWQ with bits={self.bits} is not supported: onecat reads 4-bit AWQ")
        if not config.get("zero_point", True):
            raise UnsupportedModelError("AWQ with zero_point=false is not supported: onecat reads AWQ with "
                                        "zero points (AutoAWQ's default)")

    def describe(self) -> str:
        return f"awq w{self.bits} g{self.group_size}"

    def dequantize(self, module: str, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        qweight, qzeros, scales = self.require(module, tensors, "qweight", "qzeros", "scales")
        k, n = qweight.shape[0], qweight.shape[1] * 8
        groups = scales.shape[0]
        if (qweight.dtype != torch.int32 or scales.shape != (groups, n) or qzeros.shape != (groups, n // 8)
                or groups == 0 or k % groups):
            raise self.bad(module, f"qweight {tuple(qweight.shape)} {qweight.dtype}, qzeros {tuple(qzeros.shape)}, "
                                   f"scales {tuple(scales.shape)} are not AWQ's [K, N/8], [K/G, N/8], [K/G, N]")
        if self.group_size > 0 and k // groups != self.group_size:
            raise self.bad(module, f"{groups} scale groups for {k} input rows, but group_size is {self.group_size}")
        q = awq_columns(qweight)
        z = by_group(awq_columns(qzeros), k, dim=0)
        s = by_group(scales.float(), k, dim=0)
        return ((q - z).float() * s).t().contiguous()
