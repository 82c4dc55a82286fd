"""Where the tensor-core GEMV's FP4 code slots put each code's bits (engine/quant/fp4/slots.py re-lays words into
them; csrc/quant_gemv/fp4_mma.cuh slot_pair and triton_fp4.slots_dequant_kernel read them), and which weights can
take them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_E8M0 = 128  # MXFP4 scales above this are 2^(e - 1) > bf16's largest power of two
# MXFP4: the columns of each 32 in slot order, so that the kernel's k-steps sum the columns the plain-word decode
# sums in each (fp4_mma.cuh: columns 4j .. 4j + 3), giving the same bits: pair starts 0, 4, .. 28, then 2, 6, .. 30
MXFP4_ORDER = tuple(c for start in (*range(0, 32, 4), *range(2, 32, 4)) for c in (start, start + 1))


@dataclass(frozen=True)
class SlotLayout:
    """Where a decoded code's bits must land in the low half (magnitude_to .. + 2, sign at 15) and each slot's
    left rotations (magnitude, sign) that bring them there (fp4_mma.cuh slot_pair has the same numbers)."""

    magnitude_to: int
    rotations: tuple[tuple[int, int], ...]

    def magnitude_at(self, slot: int, half: int) -> int:
        return (self.magnitude_to - self.rotations[slot][0] + 16 * half) % 32

    def sign_at(self, slot: int, half: int) -> int:
        return (15 - self.rotations[slot][1] + 16 * half) % 32


SLOTS = {torch.float16: SlotLayout(9, ((0, 0), (3, 3), (6, 1), (9, 2))),
         torch.bfloat16: SlotLayout(6, ((0, 0), (3, 4), (6, 6), (10, 5)))}


def slots_take(fmt: str, scales: torch.Tensor) -> bool:
    """Whether an FP4 weight can keep its codes in slots: NVFP4 always, MXFP4 where every scale is <= MAX_E8M0."""
    return fmt == "nvfp4" or (fmt == "mxfp4" and (scales.numel() == 0 or int(scales.max()) <= MAX_E8M0))
