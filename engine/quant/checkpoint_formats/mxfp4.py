"""MXFP4 (OCP microscaling, `quant_method: mxfp4`, as gpt-oss ships its experts).

A tensor `<name>` is stored as `<name>_blocks` uint8 [..., K/32, 16] (32 FP4 E2M1 codes per block, element
2i in the low nibble) and `<name>_scales` uint8 [..., K/32] (E8M0: the block's scale is 2**(e - 127);
e = 255 is NaN). gpt-oss quantizes only its MoE experts (transformers and vLLM read `gate_up_proj_blocks`
etc.); for a dense linear the same naming applies to its weight: `q_proj.weight_blocks` and
`q_proj.weight_scales`, giving weight [N, K]. w = e2m1 * 2**(e - 127) is exact in float32 (a power of two
times a value with two significant bits), except that 2**128 and above overflow as they do in bf16.
"""
from __future__ import annotations

import torch

from onecat.engine.quant.bits import e2m1, fp4_bytes
from onecat.engine.quant.checkpoint_formats.registry import QuantFormat, register

MX_BLOCK = 32


@register("mxfp4")
class MXFP4(QuantFormat):
    method = "mxfp4"
    parts = ("weight_blocks", "weight_scales")

    def describe(self) -> str:
        return f"mxfp4 g{MX_BLOCK}"

    def dequantize(self, module: str, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        blocks, scales = self.require(module, tensors, "weight_blocks", "weight_scales")
        if (blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.dim() != 3
                or blocks.shape[-1] != MX_BLOCK // 2 or scales.shape != blocks.shape[:-1]):
            raise self.bad(module, f"weight_blocks {tuple(blocks.shape)} {blocks.dtype} and weight_scales "
                                   f"{tuple(scales.shape)} {scales.dtype} are not MXFP4's uint8 [N, K/32, 16] "
                                   "and uint8 [N, K/32]")
        values = e2m1(fp4_bytes(blocks))  # [N, K/32, 32]
        exponent = scales.to(torch.int32) - 127
        scale = torch.ldexp(torch.ones(exponent.shape, dtype=torch.float32), exponent)
        scale = torch.where(scales == 255, torch.tensor(float("nan")), scale)
        return (values * scale.unsqueeze(-1)).flatten(-2)
