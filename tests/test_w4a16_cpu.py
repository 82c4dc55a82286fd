"""The W4A16 packed layout on CPU: the nibble layout, each checkpoint converter re-packing without changing a
value (its dequantization equals the formats' dense weight exactly), the round-to-nearest quantizer's error
bound, the CPU path of the linear layer, and the variants refused by name."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from onecat.engine.errors import UnsupportedModelError
from onecat.engine.quant.formats.gptq import GPTQ
from onecat.engine.quant.w4a16_convert import convert, from_codes
from onecat.engine.quant.w4a16_layout import dequantize, pack_codes, quantize_w4, unpack_codes
from onecat.engine.quant.w4a16_linear import W4A16Linear
from tests.w4a16_checkpoints import CASES, MODULE, stored_linear

pytest.importorskip("transformers")  # the AWQ / GPTQ writers live in test modules that need it


def test_layout_interleaves_each_group_by_nibble():
    # group 32 = 4 words: word w holds columns w, w+4, ..., w+28 in nibbles 0..7
    q = (torch.arange(64) % 16).view(1, 64)
    words = pack_codes(q, 32)
    assert words.shape == (1, 8)
    assert [(int(words[0, 1]) >> (4 * j)) & 0xF for j in range(8)] == [(1 + 4 * j) % 16 for j in range(8)]
    for group in (32, 64, 128):
        codes = torch.randint(0, 16, (6, 256), dtype=torch.int32)
        assert torch.equal(unpack_codes(pack_codes(codes, group), group), codes)


@pytest.mark.parametrize("case", CASES)
def test_converted_weight_dequantizes_to_the_formats_weight_exactly(case):
    weight = torch.randn(64, 256, generator=torch.Generator().manual_seed(1)) * 0.05
    fmt, stored = stored_linear(case, weight, seed=3)
    packed = convert(fmt, MODULE, stored)
    assert packed.group in (32, 128) and packed.qweight.shape == (64, 32)
    assert (packed.perm is not None) == (case in ("gptq-act-order", "ct-g_idx"))
    assert torch.equal(dequantize(packed), fmt.dequantize(MODULE, dict(stored)))


def test_cpu_linear_runs_on_the_exact_dense_weight():
    weight = torch.randn(48, 128, generator=torch.Generator().manual_seed(2))
    packed = quantize_w4(weight, 64)
    x = torch.randn(3, 128)
    bias = torch.randn(48)
    assert torch.equal(W4A16Linear(packed, bias)(x), F.linear(x, dequantize(packed), bias))


@pytest.mark.parametrize("group", [32, 64, 128])
def test_round_to_nearest_error_is_at_most_half_a_step(group):
    weight = torch.randn(40, 512, generator=torch.Generator().manual_seed(group)) * 0.02
    packed = quantize_w4(weight, group)
    assert packed.scales.dtype == torch.float16 and packed.zeros.dtype == torch.float16
    step = packed.scales.float().repeat_interleave(group, 1)
    # half a step, plus what rounding the scale to fp16 moves the group's ends (15 steps times 2^-11)
    err = (dequantize(packed) - weight).abs()
    assert bool((err <= step * (0.5 + 15 * 2**-11) + 1e-7).all()), float((err / step).max())


def test_larger_groups_are_stored_as_groups_of_128():
    q = torch.randint(0, 16, (8, 512), dtype=torch.int32)
    s = torch.rand(8, 2, dtype=torch.float16) + 0.1
    z = torch.randint(0, 16, (8, 2)).half()
    packed = from_codes(q, s, z)
    assert packed.group == 128 and packed.scales.shape == (8, 4)
    dense = (q.float() - z.float().repeat_interleave(256, 1)) * s.float().repeat_interleave(256, 1)
    assert torch.equal(dequantize(packed), dense)


def test_unsupported_variants_are_refused_with_the_way_out():
    q = torch.randint(0, 16, (8, 96), dtype=torch.int32)
    with pytest.raises(ValueError, match="group size 48 .* not supported by the W4A16 kernels"):
        from_codes(q, torch.ones(8, 2).half(), torch.zeros(8, 2).half())
    fmt = GPTQ({"quant_method": "gptq", "bits": 8, "group_size": 32})
    with pytest.raises(UnsupportedModelError, match="without the w4a16 quantization"):
        convert(fmt, MODULE, {})
