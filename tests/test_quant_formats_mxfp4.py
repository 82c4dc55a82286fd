"""MXFP4 checkpoints (gpt-oss's `_blocks` / `_scales` naming, on dense linears' weights): E8M0 scales,
exact dequantization, logits equal to transformers' on the dequantized weights, and malformed tensors."""
from __future__ import annotations

import math

import pytest
import torch

from onecat.engine.errors import CorruptModelError
from onecat.engine.quant.checkpoint_formats.mxfp4 import MXFP4
from tests.fp4_writer import pack_nibbles, to_e2m1
from tests.quant_checkpoints import (
    KEPT_DENSE, check_logits, check_weights, dense_dir, linear_modules, onecat_weights, quantized_dir, tiny_llama)

pytest.importorskip("transformers")

BLOCK = 32
CONFIG = {"quant_method": "mxfp4", "modules_to_not_convert": ["lm_head", KEPT_DENSE]}


def mxfp4_quantize(weight: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """OCP MX: per 32 inputs a shared exponent floor(log2(amax)) - 2 (E2M1's largest exponent), stored
    biased by 127; E2M1 codes of w / 2**exponent. Reference: the code's value times 2**exponent."""
    n, k = weight.shape
    blocks = weight.float().view(n, k // BLOCK, BLOCK)
    exponent = torch.floor(torch.log2(blocks.abs().amax(-1).clamp(min=2.0**-100))) - 2
    scale = torch.pow(2.0, exponent.double()).float()
    codes, values = to_e2m1(blocks / scale.unsqueeze(-1))
    stored = {"weight_blocks": pack_nibbles(codes).view(n, k // BLOCK, BLOCK // 2),
              "weight_scales": (exponent + 127).to(torch.uint8)}
    return stored, (values * scale.unsqueeze(-1)).view(n, k)


def test_e8m0_scales_are_powers_of_two():
    scales = torch.tensor([[127, 128, 126, 0, 254, 255]], dtype=torch.uint8)
    blocks = torch.full((1, 6, 16), 0x22, dtype=torch.uint8)  # every element 1.0
    w = MXFP4({}).dequantize("m", {"weight_blocks": blocks, "weight_scales": scales})
    assert w.shape == (1, 6 * 32)
    per_block = w.view(6, 32)[:, 0].tolist()
    assert per_block[:5] == [1.0, 2.0, 0.5, 2.0**-127, 2.0**127]
    assert math.isnan(per_block[5])  # E8M0 255 is NaN


@pytest.mark.parametrize("tie", [False, True])
def test_mxfp4_dequantizes_exactly_and_matches_transformers(tmp_path, tie):
    src, state = tiny_llama(tmp_path / "src", tie_word_embeddings=tie)
    stored, reference = {}, {}
    for m in linear_modules(state):
        stored[m], reference[m] = mxfp4_quantize(state[f"{m}.weight"])
    qdir = quantized_dir(src, tmp_path / "q", stored, CONFIG)
    # a power of two times an E2M1 value is exact in float32: exact equality
    check_weights(qdir, state, reference)
    check_logits(qdir, dense_dir(src, tmp_path / "dense", reference), "mxfp4 g32")


def test_mxfp4_misshapen_blocks_are_corrupt(tmp_path):
    src, state = tiny_llama(tmp_path / "src")
    m = linear_modules(state)[0]
    parts, _ = mxfp4_quantize(state[f"{m}.weight"])
    parts["weight_scales"] = parts["weight_scales"][:, :-1]
    with pytest.raises(CorruptModelError, match="are not MXFP4's uint8"):
        onecat_weights(quantized_dir(src, tmp_path / "q", {m: parts}, CONFIG))
