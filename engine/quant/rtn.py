"""Round-to-nearest quantization of dense weights at load, into each packed format's layout: what
`quantization` does with a dense checkpoint or with random weights (load_format dummy), with no calibration
(expect a larger quality loss than a calibrated checkpoint's; for random weights only the speed counts).

- w4a16: asymmetric 4-bit, min-max per group of 128 input columns (64 or 32 where 128 does not divide).
- nvfp4: E2M1 values, an E4M3 scale per 16 columns and one float32 scale per tensor (ModelOpt's recipe:
  tensor scale amax / (6 * 448), block scale block amax / 6 in units of it).
- mxfp4: E2M1 values, a power-of-two (E8M0) scale per 32 columns: 2^(floor(log2(block amax)) - 2), so the
  block's largest value lands in [4, 8) before rounding (OCP MX).
- fp8: E4M3 values, one float32 scale per output row (row amax / 448).
Each returns the packed weight, or None where the format's kernel cannot take the layer (in_features not a
multiple of its block): that linear stays dense and is listed in the engine's info. A tensor-parallel rank rounds
its share of a weight with the group and the maxima of the full weight where they are given (packed_shard.py), so
its share equals the slice of the full weight rounded at once.
"""
from __future__ import annotations

import torch

from onecat.engine.quant.bits import E2M1_VALUES
from onecat.engine.quant.fp4.layout import FP4Weight, from_mxfp4, from_nvfp4
from onecat.engine.quant.fp4.packing import fp4_unsupported_reason
from onecat.engine.quant.fp8.layout import BLOCK as FP8_BLOCK, FP8Weight, pack_fp8
from onecat.engine.quant.w4a16.layout import W4A16Weight, quantize_w4

RTN_GROUPS = (128, 64, 32)  # w4a16: the largest that divides in_features
E4M3_MAX, E2M1_MAX = 448.0, 6.0
_E2M1 = torch.tensor(E2M1_VALUES)


def rtn_group(in_features: int) -> int | None:
    return next((g for g in RTN_GROUPS if in_features % g == 0), None)


def quantize(weight: torch.Tensor, fmt: str, group: int | None = None, row_amax: torch.Tensor | None = None,
             tensor_amax: torch.Tensor | None = None) -> W4A16Weight | FP4Weight | FP8Weight | None:
    """The dense [N, K] `weight` rounded to nearest in `fmt` (w4a16 | nvfp4 | mxfp4 | fp8), or None. `group`
    (w4a16; default the largest of RTN_GROUPS that divides K), `row_amax` (fp8: each row's largest magnitude) and
    `tensor_amax` (nvfp4: the tensor's) default to the weight's own."""
    w = weight.detach().float()
    if fmt == "w4a16":
        group = group or rtn_group(w.shape[1])
        return None if group is None else quantize_w4(w, group)
    if fmt == "fp8":
        return quantize_fp8(w, row_amax)
    packed = quantize_nvfp4(w, tensor_amax) if fmt == "nvfp4" else quantize_mxfp4(w)
    return None if packed is None or fp4_unsupported_reason(packed) else packed


def _e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """Codes 0..15 of the E2M1 values nearest to `x` (already in units of its block scale; clamped to +-6)."""
    mag = x.abs().clamp(max=E2M1_MAX)
    index = (mag.unsqueeze(-1) - _E2M1.to(x.device)).abs().argmin(dim=-1)
    return (index + 8 * (x < 0).long()).to(torch.uint8)


def _pairs(codes: torch.Tensor) -> torch.Tensor:
    """[..., K] codes -> [..., K/2] bytes, element 2i in the low nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def quantize_nvfp4(w: torch.Tensor, tensor_amax: torch.Tensor | None = None) -> FP4Weight | None:
    n, k = w.shape
    if k % 16:
        return None
    blocks = w.reshape(n, k // 16, 16)
    amax = w.abs().amax() if tensor_amax is None else tensor_amax.to(w.device, torch.float32)
    tensor_scale = (amax / (E2M1_MAX * E4M3_MAX)).clamp(min=torch.finfo(torch.float32).tiny)
    block_scale = (blocks.abs().amax(-1) / E2M1_MAX / tensor_scale).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
    effective = block_scale.float() * tensor_scale
    scaled = torch.where(effective[..., None] > 0, blocks / effective[..., None].clamp(min=1e-30), 0.0)
    return from_nvfp4(_pairs(_e2m1_codes(scaled).reshape(n, k)), block_scale, tensor_scale.reshape(1))


def quantize_mxfp4(w: torch.Tensor) -> FP4Weight | None:
    n, k = w.shape
    if k % 32:
        return None
    blocks = w.reshape(n, k // 32, 32)
    amax = blocks.abs().amax(-1)
    exponent = torch.where(amax > 0, torch.floor(torch.log2(amax.clamp(min=2.0 ** -126))) - 2, -127.0)
    exponent = exponent.clamp(-127, 127)
    scaled = blocks / torch.ldexp(torch.ones_like(exponent), exponent.int())[..., None]
    codes = _pairs(_e2m1_codes(scaled))  # [N, K/32, 16]
    return from_mxfp4(codes, (exponent + 127).to(torch.uint8))


def quantize_fp8(w: torch.Tensor, row_amax: torch.Tensor | None = None) -> FP8Weight | None:
    if w.shape[1] % FP8_BLOCK:
        return None
    amax = w.abs().amax(dim=1) if row_amax is None else row_amax.to(w.device, torch.float32)
    scale = (amax / E4M3_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    return pack_fp8((w / scale[:, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale)
