"""Bit-level helpers the checkpoint formats and the packed layouts share: int32 bit fields, FP4 E2M1 codes,
per-group scale expansion."""
from __future__ import annotations

import torch

# FP4 E2M1 (OCP MX spec, also NVFP4): bit 3 is the sign, bits 0-2 index these magnitudes.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_E2M1 = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float32)


def unpack_int32(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Splits each int32 along `dim` into 32/bits unsigned fields, lowest bits first (field i sits at bit
    i*bits), so that dim grows by 32/bits. The fields come back as int32 in [0, 2**bits)."""
    per = 32 // bits
    dim = dim % packed.dim()
    shifts = torch.arange(0, 32, bits, dtype=torch.int32).view([per] + [1] * (packed.dim() - dim - 1))
    fields = (packed.to(torch.int32).unsqueeze(dim + 1) >> shifts) & ((1 << bits) - 1)
    return fields.flatten(dim, dim + 1)


def e2m1(codes: torch.Tensor) -> torch.Tensor:
    """FP4 E2M1 codes (0..15) as their float32 values: {0, 0.5, 1, 1.5, 2, 3, 4, 6} and their negatives."""
    return _E2M1[codes.long()]


def fp4_bytes(packed: torch.Tensor) -> torch.Tensor:
    """uint8 bytes holding two FP4 codes each, element 2i in the low nibble and 2i+1 in the high one
    (the order ModelOpt, transformers' gpt-oss loader and vLLM use): the last dim doubles."""
    b = packed.view(torch.uint8)
    return torch.stack((b & 0x0F, b >> 4), dim=-1).flatten(-2)


def by_group(t: torch.Tensor, size: int, dim: int, g_idx: torch.Tensor | None = None) -> torch.Tensor:
    """Per-group values `t` (one per group along `dim`) repeated for each of the `size` positions of
    `dim`; `g_idx` (the group of each position) when the groups are not contiguous runs."""
    if g_idx is not None:
        return t.index_select(dim, g_idx.long())
    return t.repeat_interleave(size // t.shape[dim], dim=dim)


def fp4_blocks(packed: torch.Tensor, block_scale: torch.Tensor) -> torch.Tensor:
    """[N, K/2] bytes of FP4 codes times a float32 scale per block of K (`block_scale` [N, K/block]):
    the dense [N, K] float32 weight. An E2M1 value times a scale is exact in float32 unless the scale
    itself has more than 22 significant bits."""
    values = e2m1(fp4_bytes(packed))
    n, k = values.shape
    if block_scale.dim() != 2 or block_scale.shape[0] != n or k % block_scale.shape[1]:
        raise ValueError(f"FP4 weight [{n}, {k}] and block scales {tuple(block_scale.shape)} disagree")
    return values * by_group(block_scale, k, dim=1)
