"""NVFP4 words in fp16 code slots: the layout the tensor-core GEMV decodes fastest with fp16 activations
(csrc/quant_gemv/fp4_mma.cuh nvfp4_slots_run), kept by packed layers only where that GEMV takes their calls.

Word i of a row holds columns 8i .. 8i + 7 as four pairs: slot s is columns (8i + 2s, 8i + 2s + 1), the first code
in the low 16 bits, the second in the high 16 at the same places. In each half a code's magnitude bits
(e1 e0 m) sit at MAGNITUDE_AT[s] .. + 2 and its sign at SIGN_AT[s], so that shifting the word left by
SLOT_SHIFTS[s] (magnitude, sign) puts them at bits 9-11 and 15: the fp16 of code * 2^-14, exactly (subnormal
0.5 included). Four slots of {0, 1, 2, 6} cannot tile 16 bits, so slots 2 and 3 take a second shift for the
sign; the kernel then spends 11 integer instructions and 4 HMUL2 (the block scale) on a word's 8 codes, against
20 integer instructions, 8 float32 multiplies and 4 conversions with pack_fp4's SLOTS (the float32 decode).
"""
from __future__ import annotations

import torch

from onecat.engine.quant.fp4_layout import pack_fp4, unpack_fp4

MAGNITUDE_AT = (9, 6, 3, 0)
SIGN_AT = (15, 12, 14, 13)
SLOT_SHIFTS = tuple((9 - m, 15 - s) for m, s in zip(MAGNITUDE_AT, SIGN_AT))  # ((0, 0), (3, 3), (6, 1), (9, 2))
NVFP4_BLOCK = 16


def pack_fp16_slots(codes: torch.Tensor) -> torch.Tensor:
    """[N, K] E2M1 codes 0..15 (K a multiple of 8) -> int32 [N, K / 8] in fp16 code slots."""
    n, k = codes.shape
    if k % 8:
        raise ValueError(f"fp16 code slots take K a multiple of 8, got {k}")
    c = codes.to(torch.int64).reshape(n, k // 8, 4, 2)  # [N, word, slot, low/high half]
    magnitude, sign = c & 7, (c >> 3) & 1
    words = torch.zeros(n, k // 8, dtype=torch.int64, device=codes.device)
    for s in range(4):
        for half in range(2):
            words |= magnitude[:, :, s, half] << (MAGNITUDE_AT[s] + 16 * half)
            words |= sign[:, :, s, half] << (SIGN_AT[s] + 16 * half)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def unpack_fp16_slots(words: torch.Tensor) -> torch.Tensor:
    """int32 [N, K / 8] from pack_fp16_slots -> [N, K] int32 codes in column order."""
    n, kw = words.shape
    w = words.to(torch.int64) & 0xFFFFFFFF
    codes = torch.empty(n, kw, 4, 2, dtype=torch.int64, device=words.device)
    for s in range(4):
        for half in range(2):
            magnitude = (w >> (MAGNITUDE_AT[s] + 16 * half)) & 7
            codes[:, :, s, half] = magnitude | (((w >> (SIGN_AT[s] + 16 * half)) & 1) << 3)
    return codes.reshape(n, kw * 8).to(torch.int32)


CHUNK_CODES = 1 << 24  # codes re-laid at once: the int64 temporaries stay near 1 GB for any weight


def _by_rows(words: torch.Tensor, convert) -> torch.Tensor:
    rows = max(1, CHUNK_CODES // (8 * max(1, words.shape[1])))
    return torch.cat([convert(words[i:i + rows]) for i in range(0, words.shape[0], rows)])


def to_fp16_slots(qweight: torch.Tensor) -> torch.Tensor:
    """NVFP4 words of fp4_layout.pack_fp4 (row-major) -> the same weight in fp16 code slots."""
    return _by_rows(qweight, lambda w: pack_fp16_slots(unpack_fp4(w, NVFP4_BLOCK)))


def from_fp16_slots(words: torch.Tensor) -> torch.Tensor:
    """The inverse of to_fp16_slots."""
    return _by_rows(words, lambda w: pack_fp4(unpack_fp16_slots(w), NVFP4_BLOCK))
