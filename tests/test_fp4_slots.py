"""NVFP4 words in code slots (engine/quant/fp4/slots.py): the layout round trip, and that the tensor-core GEMV's
decode (rotations and masks: fp4_mma.cuh slot_pair) of every code in every slot is the fp16 of code * 2^-14 or the
bf16 of code * 2^-126. Pure torch, so it runs on CPU; tests/test_quant_gemv_gpu.py checks the kernel itself to
the same bits."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from onecat.engine.kernels.fp4_slot_bits import SLOTS, slots_take
from onecat.engine.quant.bits import E2M1_VALUES
from onecat.engine.quant.fp4.layout import pack_fp4, unpack_fp4
from onecat.engine.quant.fp4.slots import from_slots, pack_slots, to_slots, unpack_slots

DTYPES = [torch.float16, torch.bfloat16]
# what the decoded bits are: the fp16 of code * 2^-14 (magnitude to bits 9-11), the bf16 of code * 2^-126 (6-8)
DECODED = {torch.float16: (0x0E000E00, 2.0 ** 14), torch.bfloat16: (0x01C001C0, 2.0 ** 126)}

SIGNED_E2M1 = E2M1_VALUES + tuple(-v for v in E2M1_VALUES)  # code 0..15 -> value


def random_codes(n: int, k: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 16, (n, k), generator=torch.Generator().manual_seed(seed), dtype=torch.int32)


def rotl(w: np.ndarray, r: int) -> np.ndarray:
    return (w << np.uint32(r)) | (w >> np.uint32((32 - r) % 32)) if r else w


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt,block", [("nvfp4", 16), ("mxfp4", 32)])
def test_codes_round_trip_and_match_the_plain_layout(dtype, fmt, block):
    codes = random_codes(48, 256, 0)
    words = pack_slots(codes, dtype, fmt)
    assert words.shape == (48, 32) and words.dtype == torch.int32
    assert torch.equal(unpack_slots(words, dtype, fmt), codes)
    plain = pack_fp4(codes, block)
    assert torch.equal(to_slots(plain, dtype, fmt), words)
    assert torch.equal(from_slots(words, dtype, fmt), plain)
    assert torch.equal(unpack_fp4(from_slots(words, dtype, fmt), block), codes)
    if fmt == "mxfp4":  # columns 4j .. 4j + 3 of each 32 are k-step j's: word j // 4 and word 2 + j // 4, slot j % 4
        nv = unpack_slots(words, dtype)  # the words read in plain slot order
        for j in range(8):
            for half in range(2):
                assert torch.equal(nv[:, 8 * (j // 4) + 2 * (j % 4) + half], codes[:, 4 * j + half])
                assert torch.equal(nv[:, 16 + 8 * (j // 4) + 2 * (j % 4) + half], codes[:, 4 * j + 2 + half])


def test_mxfp4_takes_slots_only_where_bf16_holds_every_scale():
    scales = torch.full((4, 8), 127, dtype=torch.uint8)
    assert slots_take("mxfp4", scales) and slots_take("nvfp4", scales)
    scales[2, 5] = 129
    assert not slots_take("mxfp4", scales) and not slots_take("fp8", scales)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_kernels_rotations_and_masks_give_each_code_scaled_by_a_power_of_two(dtype):
    """Every code 0..15 in every slot and half: rotl(w, magnitude) & magnitude mask | rotl(w, sign) & 0x80008000
    read as two 16-bit floats is the pair of e2m1 values times 2^-14 (fp16) or 2^-126 (bf16)."""
    magnitude_mask, power = DECODED[dtype]
    lo, hi = torch.meshgrid(torch.arange(16), torch.arange(16), indexing="ij")
    pairs = torch.stack([lo.flatten(), hi.flatten()], dim=1)  # all 256 (code, code') pairs
    for slot, (magnitude_rot, sign_rot) in enumerate(SLOTS[dtype].rotations):
        codes = torch.zeros(256, 8, dtype=torch.int32)
        codes[:, 2 * slot:2 * slot + 2] = pairs
        codes[:, (2 * slot + 2) % 8] = 15  # a neighbouring slot full of ones must not leak in
        w = pack_slots(codes, dtype)[:, 0].numpy().view(np.uint32)
        bits = (rotl(w, magnitude_rot) & np.uint32(magnitude_mask)) | (rotl(w, sign_rot) & np.uint32(0x80008000))
        halves = torch.from_numpy(bits.view(np.int16).copy()).view(dtype).double().reshape(256, 2) * power
        want = torch.tensor([[SIGNED_E2M1[a], SIGNED_E2M1[b]] for a, b in pairs.tolist()], dtype=torch.float64)
        assert torch.equal(halves, want), slot


def test_k_not_a_multiple_of_eight_and_other_dtypes_are_refused():
    with pytest.raises(ValueError, match="multiple of 8"):
        pack_slots(torch.zeros(2, 12, dtype=torch.int32), torch.float16)
    with pytest.raises(ValueError, match="multiple of 32"):
        pack_slots(torch.zeros(2, 48, dtype=torch.int32), torch.bfloat16, "mxfp4")
    with pytest.raises(ValueError, match="fp16 or bf16"):
        pack_slots(torch.zeros(2, 16, dtype=torch.int32), torch.float32)


def test_large_weights_are_re_laid_in_row_chunks(monkeypatch):
    from onecat.engine.quant.fp4 import slots as fp4_slots

    codes = random_codes(40, 128, 1)
    plain = pack_fp4(codes, 16)
    whole = to_slots(plain, torch.bfloat16)
    monkeypatch.setattr(fp4_slots, "CHUNK_CODES", 3 * 128)  # three rows a chunk: 14 chunks, the last one short
    assert torch.equal(to_slots(plain, torch.bfloat16), whole)
    assert torch.equal(from_slots(whole, torch.bfloat16), plain)
