"""FP4 words in code slots: the layout the tensor-core GEMV decodes fastest (csrc/quant_gemv/fp4_mma.cuh
slots_run), one per activation dtype, kept by NVFP4 and MXFP4 layers only where that GEMV takes their calls.

Word i of a row holds columns 8i .. 8i + 7 as four pairs: slot s is columns (8i + 2s, 8i + 2s + 1) (MXFP4: each 32
columns taken in MXFP4_ORDER), the first code in one 16-bit half, the second in the other half at the same places
(16 bits on). Rotating the word left by a slot's rotations (magnitude, sign) and masking puts the first code's
magnitude bits (e1 e0 m) and sign where the low half's fp16 or bf16 reads code * 2^-14 (fp16: bits 9-11 and 15)
or code * 2^-126 (bf16: bits 6-8 and 15), exactly, subnormal 0.5 included, and the second code in the high half.
The block scale then multiplies a pair as one 16-bit float: NVFP4's e4m3 * 2^7 (fp16) or * 2^119 (bf16), MXFP4's
2^(e - 1) (bf16 only), which bf16 holds for e <= MAX_E8M0 (slots_take: weights with larger scales keep
fp4/layout.py's words). Four slots of one rotation each cannot tile 16 bits, so two slots take a second rotation for
the sign: 11 integer instructions for a word's 8 codes and 4 HMUL2 (the block scale), against 20 integer
instructions, 8 float32 multiplies and 4 conversions with pack_fp4's SLOTS (the float32 decode). The bit places
and the MXFP4 rule are engine/kernels/fp4_slot_bits.py's (the kernels read them); this module re-lays the words.
"""
from __future__ import annotations

import torch

from onecat.engine.kernels.fp4_slot_bits import MXFP4_ORDER, SLOTS, SlotLayout
from onecat.engine.quant.fp4.layout import FP4_BLOCKS, pack_fp4, unpack_fp4

CHUNK_CODES = 1 << 24  # codes re-laid at once: the int64 temporaries stay near 1 GB for any weight


def _layout(dtype: torch.dtype) -> SlotLayout:
    if dtype not in SLOTS:
        raise ValueError(f"code slots are laid for fp16 or bf16 activations, got {dtype}")
    return SLOTS[dtype]


def _mxfp4_order(codes: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    n, k = codes.shape
    order = torch.tensor(MXFP4_ORDER, device=codes.device)
    if inverse:
        order = torch.argsort(order)
    return codes.reshape(n, k // 32, 32)[:, :, order].reshape(n, k)


def pack_slots(codes: torch.Tensor, dtype: torch.dtype, fmt: str = "nvfp4") -> torch.Tensor:
    """[N, K] E2M1 codes 0..15 (K a multiple of 8, MXFP4 of 32) -> int32 [N, K / 8] in dtype's code slots."""
    layout = _layout(dtype)
    n, k = codes.shape
    unit = 32 if fmt == "mxfp4" else 8
    if k % unit:
        raise ValueError(f"{fmt} code slots take K a multiple of {unit}, got {k}")
    if fmt == "mxfp4":
        codes = _mxfp4_order(codes)
    c = codes.to(torch.int64).reshape(n, k // 8, 4, 2)  # [N, word, slot, first/second code]
    magnitude, sign = c & 7, (c >> 3) & 1
    words = torch.zeros(n, k // 8, dtype=torch.int64, device=codes.device)
    for s in range(4):
        for half in range(2):
            words |= magnitude[:, :, s, half] << layout.magnitude_at(s, half)
            words |= sign[:, :, s, half] << layout.sign_at(s, half)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def unpack_slots(words: torch.Tensor, dtype: torch.dtype, fmt: str = "nvfp4") -> torch.Tensor:
    """int32 [N, K / 8] from pack_slots -> [N, K] int32 codes in column order."""
    layout = _layout(dtype)
    n, kw = words.shape
    w = words.to(torch.int64) & 0xFFFFFFFF
    codes = torch.empty(n, kw, 4, 2, dtype=torch.int64, device=words.device)
    for s in range(4):
        for half in range(2):
            magnitude = (w >> layout.magnitude_at(s, half)) & 7
            codes[:, :, s, half] = magnitude | (((w >> layout.sign_at(s, half)) & 1) << 3)
    codes = codes.reshape(n, kw * 8).to(torch.int32)
    return _mxfp4_order(codes, inverse=True) if fmt == "mxfp4" else codes


def _by_rows(words: torch.Tensor, convert) -> torch.Tensor:
    rows = max(1, CHUNK_CODES // (8 * max(1, words.shape[1])))
    return torch.cat([convert(words[i:i + rows]) for i in range(0, words.shape[0], rows)])


def to_slots(qweight: torch.Tensor, dtype: torch.dtype, fmt: str = "nvfp4") -> torch.Tensor:
    """FP4 words of fp4.layout.pack_fp4 (row-major) -> the same weight in dtype's code slots."""
    return _by_rows(qweight, lambda w: pack_slots(unpack_fp4(w, FP4_BLOCKS[fmt]), dtype, fmt))


def from_slots(words: torch.Tensor, dtype: torch.dtype, fmt: str = "nvfp4") -> torch.Tensor:
    """The inverse of to_slots."""
    return _by_rows(words, lambda w: pack_fp4(unpack_slots(w, dtype, fmt), FP4_BLOCKS[fmt]))
