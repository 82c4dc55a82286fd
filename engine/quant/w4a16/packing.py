"""4-bit checkpoint tensors (AWQ, GPTQ, compressed-tensors pack-quantized) -> the packed W4A16 layout.

Each converter reads the same fields the dequantizing readers of engine/quant/checkpoint_formats read, with
their conventions (AWQ's nibble order, GPTQ v1's zero - 1, compressed-tensors' signed codes stored as q + 8),
and re-packs codes, scales and zeros without changing a value: dequantizing the result gives exactly
the formats' dense weight. Act-order checkpoints (a g_idx that scatters the groups over K) are stored
with their columns sorted by group and a permutation the layer applies to its input.
"""
from __future__ import annotations

import math

import torch

from onecat.engine.errors import UnsupportedModelError
from onecat.engine.quant.bits import unpack_int32
from onecat.engine.quant.checkpoint_formats import QuantFormat
from onecat.engine.quant.checkpoint_formats.awq import awq_columns
from onecat.engine.quant.w4a16.layout import W4A16Weight, from_codes


def _act_order(g_idx: torch.Tensor | None, k: int, groups: int, what: str) -> torch.Tensor | None:
    """The column permutation that makes each group one run (None when the groups already are runs)."""
    if g_idx is None:
        return None
    g_idx = g_idx.to(torch.int64)
    if g_idx.shape != (k,) or int(g_idx.min()) < 0 or int(g_idx.max()) >= groups:
        raise UnsupportedModelError(f"{what}: g_idx {tuple(g_idx.shape)} does not map {k} input columns to {groups} "
                                    "groups")
    if torch.equal(g_idx, torch.arange(k) // (k // groups)):
        return None
    if not torch.equal(torch.bincount(g_idx, minlength=groups), torch.full((groups,), k // groups)):
        raise UnsupportedModelError(f"{what}: its act-order groups are not all {k // groups} columns, which the W4A16 "
                                    "layout needs; load the checkpoint without the w4a16 quantization (dequantized)")
    return torch.sort(g_idx, stable=True).indices


def _build(q: torch.Tensor, s: torch.Tensor, z: torch.Tensor, g_idx, what: str) -> W4A16Weight:
    """q [N, K], s and z [N, K/G] in the layer's column order and group numbering -> packed."""
    perm = _act_order(g_idx, q.shape[1], s.shape[1], what)
    if perm is not None:
        q = q.index_select(1, perm)
    try:
        return from_codes(q, s, z, perm, what)
    except ValueError as e:
        raise UnsupportedModelError(str(e)) from None


def from_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, what: str = "awq") -> W4A16Weight:
    """AWQ GEMM: qweight [K, N/8], qzeros [K/G, N/8] (AWQ nibble order), scales [K/G, N]."""
    q = awq_columns(qweight).t()
    z = awq_columns(qzeros).t()
    return _build(q, scales.t(), z, None, what)


def from_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor | None = None,
              v1: bool = True, what: str = "gptq") -> W4A16Weight:
    """4-bit GPTQ: qweight [K/8, N] packed along K, qzeros [K/G, N/8] (v1 stores zero - 1), scales [K/G, N],
    g_idx [K] (optional)."""
    q = unpack_int32(qweight, 4, dim=0).t()
    z = unpack_int32(qzeros, 4, dim=1).t() + (1 if v1 else 0)
    return _build(q, scales.t(), z, g_idx, what)


def from_compressed_tensors(weight_packed: torch.Tensor, weight_shape: torch.Tensor, weight_scale: torch.Tensor,
                            weight_zero_point: torch.Tensor | None = None, weight_g_idx: torch.Tensor | None = None,
                            what: str = "compressed-tensors") -> W4A16Weight:
    """pack-quantized 4-bit: weight_packed [N, K/8] (signed codes stored as q + 8), weight_scale [N, K/G] or
    [N, 1], weight_zero_point (signed; absent when symmetric, packed along N when asymmetric)."""
    n, k = (int(v) for v in weight_shape.tolist())
    if weight_packed.dtype != torch.int32 or weight_packed.shape != (n, math.ceil(k / 8)):
        raise UnsupportedModelError(f"{what}: weight_packed {tuple(weight_packed.shape)} {weight_packed.dtype} is not "
                                    f"[{n}, {k}] 4-bit codes")
    q = unpack_int32(weight_packed, 4, dim=1)[:, :k]
    s = weight_scale.reshape(n, -1) if weight_scale.numel() > 1 else weight_scale.reshape(1, 1).expand(n, 1)
    z = weight_zero_point
    if z is None:
        z = torch.zeros(n, s.shape[1], dtype=torch.int32)
    elif z.dtype == torch.int32 and z.shape[0] == math.ceil(n / 8) != n:
        z = unpack_int32(z, 4, dim=0)[:n] - 8
    z = z.reshape(n, -1) if z.numel() > 1 else z.reshape(1, 1).expand(n, 1)
    return _build(q, s, z.to(torch.int32) + 8, weight_g_idx, what)


def convert(fmt: QuantFormat, module: str, tensors: dict[str, torch.Tensor]) -> W4A16Weight:
    """One stored linear of a 4-bit AWQ, GPTQ or compressed-tensors pack-quantized checkpoint -> packed.
    Anything else is refused with the reason: load such a checkpoint without the w4a16 quantization."""
    what = f"{fmt.describe()} checkpoint: {module}"
    bits = getattr(fmt, "bits", None)
    if fmt.method == "awq":
        qweight, qzeros, scales = fmt.require(module, tensors, "qweight", "qzeros", "scales")
        return from_awq(qweight, qzeros, scales, what)
    if fmt.method == "gptq" and bits == 4:
        qweight, qzeros, scales = fmt.require(module, tensors, "qweight", "qzeros", "scales")
        return from_gptq(qweight, qzeros, scales, tensors.get("g_idx"), v1=fmt.layout == "gptq", what=what)
    if fmt.method == "compressed-tensors" and "weight_packed" in tensors \
            and tensors["weight_packed"].dtype == torch.int32:
        packed, shape, scale = fmt.require(module, tensors, "weight_packed", "weight_shape", "weight_scale")
        n, k = (int(v) for v in shape.tolist())
        if packed.shape[1] * 32 // k != 4 or (fmt.scheme(module).get("weights") or {}).get("num_bits", 4) != 4:
            raise UnsupportedModelError(f"{what}: only 4-bit pack-quantized weights run on the W4A16 kernels; load "
                                        "the checkpoint without the w4a16 quantization (dequantized)")
        return from_compressed_tensors(packed, shape, scale, tensors.get("weight_zero_point"),
                                       tensors.get("weight_g_idx"), what)
    raise UnsupportedModelError(f"{what}: the W4A16 kernels take 4-bit AWQ, 4-bit GPTQ and compressed-tensors "
                                "4-bit pack-quantized weights; load this checkpoint without the w4a16 quantization "
                                "(dequantized)")
