"""The packed FP8 (W8A16) layout the CUDA GEMV reads, built from an E4M3 checkpoint without changing a value.

A [N, K] float8_e4m3fn weight is held as
  qweight int32 [N, K/4]: within each block of 16 columns, word w (of 4) holds the columns w + 4j in byte j
      (the W4A16 interleave: one j's activations are a contiguous run of four);
  scale float32 [N]: the weight scale per output row (a per-tensor scale is repeated).
w[n, k] = e4m3 * scale[n]: exact in float32. Block-wise (2-D) scales are not packed: such layers stay dense.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK = 16


@dataclass
class FP8Weight:
    qweight: torch.Tensor
    scale: torch.Tensor

    @property
    def out_features(self) -> int:
        return self.qweight.shape[0]

    @property
    def in_features(self) -> int:
        return self.qweight.shape[1] * 4

    def to(self, device) -> FP8Weight:
        return FP8Weight(self.qweight.to(device), self.scale.to(device))

    def nbytes(self) -> int:
        return self.qweight.numel() * 4 + self.scale.numel() * 4


def pack_fp8(weight: torch.Tensor, scale: torch.Tensor) -> FP8Weight:
    """float8_e4m3fn [N, K] (K a multiple of 16) and a scale per tensor ([] or [1]) or per row ([N] / [N, 1])."""
    n, k = weight.shape
    if weight.dtype != torch.float8_e4m3fn or k % BLOCK:
        raise ValueError(f"FP8 weight {tuple(weight.shape)} {weight.dtype}: expected float8_e4m3fn with in_features "
                         f"a multiple of {BLOCK}")
    if scale.numel() not in (1, n):
        raise ValueError(f"FP8 scale of {scale.numel()} values for {n} rows: expected one per tensor or per row")
    b = weight.view(torch.uint8).to(torch.int64).reshape(n, k // BLOCK, 4, 4).transpose(2, 3)  # [N, blk, word, j]
    words = (b << torch.arange(0, 32, 8, dtype=torch.int64, device=b.device)).sum(-1)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32).reshape(n, k // 4)
    return FP8Weight(words.contiguous(), scale.float().reshape(-1).expand(n).contiguous())


def codes(w: FP8Weight) -> torch.Tensor:
    """The [N, K] float8_e4m3fn codes of the packed words: byte j of word i of a 16-column block is column 4 j + i
    (pack_fp8), taken with byte views and one copy, on the words' device."""
    n, kw = w.qweight.shape
    b = w.qweight.contiguous().view(torch.uint8).view(n, kw // 4, 4, 4).transpose(2, 3).reshape(n, kw * 4)
    return b.view(torch.float8_e4m3fn)


def dequantize(w: FP8Weight) -> torch.Tensor:
    """The exact float32 [N, K] weight."""
    return codes(w).float() * w.scale[:, None]
