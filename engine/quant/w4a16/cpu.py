"""W4A16 checkpoints (AWQ, GPTQ, compressed-tensors, or quantized at load) on CPU: the same 4-bit codes
in the packed int4 layer the GGUF path uses (engine/quant/int4/linear.py).

A W4A16 group of G input columns (G a multiple of 32) holds w = (q - z) * s. The CPU kernel computes
blocks of 32 as w = (q - 8) * scale + zero, so each group becomes G / 32 blocks with scale = s and
zero = (8 - z) * s, both rounded to the kernel's bfloat16 as GGUF's are: the codes stay the checkpoint's,
the scales lose the bits bfloat16 does not hold (relative 2^-9). Act-order layers (a column permutation
whose groups are scattered over the input) have no such blocks in input order and stay dense.
"""
from __future__ import annotations

import torch

from onecat.engine.quant.int4.layout import GROUP, Int4Blocks
from onecat.engine.quant.w4a16.layout import W4A16Weight, unpack_codes


def int4_blocks(w: W4A16Weight) -> Int4Blocks | None:
    """The weight as the CPU int4 kernel's blocks of 32, or None when it has none (act-order, or a
    group that is not a multiple of 32)."""
    if w.perm is not None or w.group % GROUP:
        return None
    reps = w.group // GROUP
    s = w.scales.float().repeat_interleave(reps, dim=1)
    z = w.zeros.float().repeat_interleave(reps, dim=1)
    codes = unpack_codes(w.qweight, w.group).to(torch.uint8)
    return Int4Blocks(codes, s, (8.0 - z) * s)
