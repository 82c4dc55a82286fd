"""4-bit block-quantized weights as GGUF stores them, decoded to codes + per-block scale and offset.

GGUF Q4_0 and Q4_1 both store 32-value blocks of 4-bit codes q in [0, 15]:
  Q4_0: w = d * (q - 8)        Q4_1: w = d * q + m
Both are written here in one form, w = (q - 8) * scale + zero, which is the form the packed matmul
kernel computes, so the run-time weights are the file's weights (scale and zero rounded to the
kernel's bf16). Q8_0 (w = d * q, q in [-127, 127]) is exactly the sum of two such 4-bit terms:
q = 16 * hi + lo with hi in [-8, 7] and lo in [0, 15], so w = (16 d) * hi + d * lo.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

GROUP = 32
INT4_GGUF_TYPES = ("Q4_0", "Q4_1")
PACKABLE_GGUF_TYPES = INT4_GGUF_TYPES + ("Q8_0",)


@dataclass
class Int4Blocks:
    codes: torch.Tensor  # uint8 [N, K], values 0..15
    scale: torch.Tensor  # float32 [N, K // GROUP]
    zero: torch.Tensor  # float32 [N, K // GROUP]

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    def dequantize(self) -> torch.Tensor:
        n, k = self.shape
        q = self.codes.view(n, k // GROUP, GROUP).float() - 8.0
        return (q * self.scale[..., None] + self.zero[..., None]).view(n, k)

    def permute_rows(self, index: torch.Tensor) -> "Int4Blocks":
        return Int4Blocks(self.codes[index], self.scale[index], self.zero[index])

    @staticmethod
    def cat(parts: list["Int4Blocks"]) -> "Int4Blocks":
        return Int4Blocks(torch.cat([p.codes for p in parts]), torch.cat([p.scale for p in parts]),
                          torch.cat([p.zero for p in parts]))

    @classmethod
    def from_gguf(cls, qtype: str, raw: np.ndarray, shape: tuple[int, int]) -> list["Int4Blocks"]:
        """The 4-bit terms whose sum is the tensor. `raw`: its bytes (a row of blocks per output row)."""
        if qtype == "Q8_0":
            return cls._from_q8_0(raw, shape)
        return [cls._from_q4(qtype, raw, shape)]

    @classmethod
    def _from_q8_0(cls, raw: np.ndarray, shape: tuple[int, int]) -> list["Int4Blocks"]:
        n, k = shape
        blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(n, k // GROUP, 34)
        d = torch.from_numpy(blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32))
        q = torch.from_numpy(blocks[..., 2:].copy().view(np.int8).reshape(n, k)).to(torch.int16)
        hi, lo = torch.div(q, 16, rounding_mode="floor"), torch.remainder(q, 16)
        return [cls((hi + 8).to(torch.uint8), 16 * d, torch.zeros_like(d)),
                cls(lo.to(torch.uint8), d.clone(), 8 * d)]

    @classmethod
    def _from_q4(cls, qtype: str, raw: np.ndarray, shape: tuple[int, int]) -> "Int4Blocks":
        n, k = shape
        has_min = qtype == "Q4_1"
        block_bytes = 20 if has_min else 18
        blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(n, k // GROUP, block_bytes)
        d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
        nib = blocks[..., (4 if has_min else 2):]
        codes = np.concatenate([nib & 0x0F, nib >> 4], axis=-1).reshape(n, k)
        if has_min:
            m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
            zero = m + 8.0 * d
        else:
            zero = np.zeros_like(d)
        return cls(torch.from_numpy(codes.copy()), torch.from_numpy(d), torch.from_numpy(zero))


@dataclass
class QuantizedWeight:
    """A checkpoint tensor kept quantized: the sum of its 4-bit terms (one for Q4_*, two for Q8_0)."""

    qtype: str
    terms: list[Int4Blocks]

    @property
    def shape(self) -> tuple[int, int]:
        return self.terms[0].shape

    def dequantize(self) -> torch.Tensor:
        out = self.terms[0].dequantize()
        for t in self.terms[1:]:
            out += t.dequantize()
        return out

    def permute_rows(self, index: torch.Tensor) -> "QuantizedWeight":
        return QuantizedWeight(self.qtype, [t.permute_rows(index) for t in self.terms])

    @classmethod
    def from_gguf(cls, qtype: str, raw: np.ndarray, shape: tuple[int, int]) -> "QuantizedWeight":
        return cls(qtype, Int4Blocks.from_gguf(qtype, raw, shape))

    @staticmethod
    def cat(parts: list["QuantizedWeight"]) -> "QuantizedWeight | None":
        """Row-concatenate shards (fused q/k/v, gate/up); None when their term counts differ."""
        if len({len(p.terms) for p in parts}) != 1:
            return None
        qtype = "+".join(sorted({p.qtype for p in parts}))
        return QuantizedWeight(qtype, [Int4Blocks.cat([p.terms[i] for p in parts]) for i in range(len(parts[0].terms))])
