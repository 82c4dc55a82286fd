"""A small FP4 E2M1 writer for the NVFP4 and MXFP4 tests, written from the published tables: codes 0-7 are
the magnitudes below, bit 3 the sign; two codes per byte, element 2i in the low nibble."""
from __future__ import annotations

import torch

E2M1_MAGNITUDES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def to_e2m1(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Nearest E2M1 code of each value (saturating at 6) and the value that code stands for."""
    mags = torch.tensor(E2M1_MAGNITUDES)
    idx = (x.abs().unsqueeze(-1) - mags).abs().argmin(-1)
    negative = x < 0
    codes = idx | (negative.long() << 3)
    values = torch.where(negative, -mags[idx], mags[idx])
    return codes, values


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """[..., 2m] codes -> [..., m] uint8, element 2i low nibble, 2i+1 high nibble."""
    pairs = codes.view(*codes.shape[:-1], -1, 2)
    return (pairs[..., 0] | (pairs[..., 1] << 4)).to(torch.uint8)
