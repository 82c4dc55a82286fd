"""NVFP4 words in fp16 code slots (engine/quant/fp4_slots.py): the layout round trip, and that the tensor-core
GEMV's decode (shift, mask: fp4_mma.cuh slot_pair) of every code in every slot is the fp16 of code * 2^-14.
Pure torch, so it runs on CPU; tests/test_quant_gemv_gpu.py checks the kernel itself to the same bits."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from onecat.engine.quant.formats.bits import E2M1_VALUES
from onecat.engine.quant.fp4_layout import pack_fp4, unpack_fp4
from onecat.engine.quant.fp4_slots import (SLOT_SHIFTS, from_fp16_slots, pack_fp16_slots, to_fp16_slots,
                                           unpack_fp16_slots)

SIGNED_E2M1 = E2M1_VALUES + tuple(-v for v in E2M1_VALUES)  # code 0..15 -> value


def random_codes(n: int, k: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 16, (n, k), generator=torch.Generator().manual_seed(seed), dtype=torch.int32)


def test_codes_round_trip_and_match_the_plain_layout():
    codes = random_codes(48, 256, 0)
    words = pack_fp16_slots(codes)
    assert words.shape == (48, 32) and words.dtype == torch.int32
    assert torch.equal(unpack_fp16_slots(words), codes)
    plain = pack_fp4(codes, 16)
    assert torch.equal(to_fp16_slots(plain), words)
    assert torch.equal(from_fp16_slots(words), plain)
    assert torch.equal(unpack_fp4(from_fp16_slots(words), 16), codes)


def test_the_kernels_shift_and_mask_give_each_code_times_two_to_the_minus_14():
    """Every code 0..15 in every slot and half: (w << magnitude shift) & 0x0E000E00 | (w << sign shift) &
    0x80008000 read as two fp16 is the pair of e2m1 values * 2^-14 (slots 0 and 1 share one shift)."""
    lo, hi = torch.meshgrid(torch.arange(16), torch.arange(16), indexing="ij")
    pairs = torch.stack([lo.flatten(), hi.flatten()], dim=1)  # all 256 (code, code') pairs
    for slot, (magnitude_shift, sign_shift) in enumerate(SLOT_SHIFTS):
        codes = torch.zeros(256, 8, dtype=torch.int32)
        codes[:, 2 * slot:2 * slot + 2] = pairs
        codes[:, (2 * slot + 2) % 8] = 15  # a neighbouring slot full of ones must not leak in
        w = pack_fp16_slots(codes)[:, 0].numpy().view(np.uint32)
        bits = (((w << np.uint32(magnitude_shift)) & np.uint32(0x0E000E00))
                | ((w << np.uint32(sign_shift)) & np.uint32(0x80008000)))
        halves = bits.view(np.uint16).view(np.float16).reshape(256, 2).astype(np.float64) * 2.0 ** 14
        want = np.array([[SIGNED_E2M1[a], SIGNED_E2M1[b]] for a, b in pairs.tolist()])
        assert np.array_equal(halves, want), slot
    assert SLOT_SHIFTS[0][0] == SLOT_SHIFTS[0][1] and SLOT_SHIFTS[1][0] == SLOT_SHIFTS[1][1]


def test_k_not_a_multiple_of_eight_is_refused():
    with pytest.raises(ValueError, match="multiple of 8"):
        pack_fp16_slots(torch.zeros(2, 12, dtype=torch.int32))


def test_large_weights_are_re_laid_in_row_chunks(monkeypatch):
    from onecat.engine.quant import fp4_slots

    codes = random_codes(40, 128, 1)
    plain = pack_fp4(codes, 16)
    whole = to_fp16_slots(plain)
    monkeypatch.setattr(fp4_slots, "CHUNK_CODES", 3 * 128)  # three rows a chunk: 14 chunks, the last one short
    assert torch.equal(to_fp16_slots(plain), whole)
    assert torch.equal(from_fp16_slots(whole), plain)
