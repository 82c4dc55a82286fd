"""GPTQ checkpoints: packing along K, the v1 zero - 1 convention (and v2), act-order g_idx, 4 and 8 bits,
exact dequantization, logits equal to transformers' on the dequantized weights, and refusals."""
from __future__ import annotations

import pytest
import torch

from onecat.engine.errors import CorruptModelError, UnsupportedModelError
from onecat.engine.quant.bits import unpack_int32
from tests.quant_checkpoints import (
    check_logits, check_weights, dense_dir, int32_words, linear_modules, onecat_weights,
    quantized_dir, tiny_llama)

pytest.importorskip("transformers")

GROUP = 32


def gptq_pack(values: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """b-bit values packed into int32 along `dim`, field j of word i holding element 32/b*i + j."""
    per = 32 // bits
    v = values.long().movedim(dim, 0)
    acc = torch.zeros((v.shape[0] // per, *v.shape[1:]), dtype=torch.int64)
    for j in range(per):
        acc |= v[j::per] << (bits * j)
    return int32_words(acc).movedim(0, dim).contiguous()


def gptq_quantize(weight: torch.Tensor, bits: int, sym: bool, act_order: bool, v2: bool, seed: int):
    """Min-max GPTQ-style quantization of [N, K] `weight` by groups of GROUP input rows (in a random
    activation order when act_order): the stored parts and their exact dequantization."""
    w = weight.t().float()  # GPTQ stores [K, N]
    k, n = w.shape
    top = 2**bits - 1
    order = torch.randperm(k, generator=torch.Generator().manual_seed(seed)) if act_order else torch.arange(k)
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[order] = torch.arange(k, dtype=torch.int32) // GROUP  # the i-th row visited joins group i // GROUP
    scales, zeros = torch.empty(k // GROUP, n), torch.empty(k // GROUP, n)
    for g in range(k // GROUP):
        rows = w[g_idx == g]
        if sym:
            scales[g] = (rows.abs().amax(0) / (2 ** (bits - 1) - 1)).clamp(min=1e-4)
            zeros[g] = 2 ** (bits - 1)
        else:
            lo, hi = rows.amin(0).clamp(max=0), rows.amax(0).clamp(min=0)
            scales[g] = ((hi - lo) / top).clamp(min=1e-4)
            zeros[g] = (-lo / scales[g].half().float()).round().clamp(0 if v2 else 1, top)  # v1 cannot store 0
    scales = scales.half()
    s, z = scales.float()[g_idx.long()], zeros[g_idx.long()]
    q = (w / s + z).round().clamp(0, top)
    stored = {"qweight": gptq_pack(q.int(), bits, 0), "scales": scales, "g_idx": g_idx,
              "qzeros": gptq_pack((zeros - (0 if v2 else 1)).int(), bits, 1)}
    return stored, ((q - z) * s).t().contiguous()


def config(bits=4, sym=False, desc_act=False, **kw) -> dict:
    return {"quant_method": "gptq", "bits": bits, "group_size": GROUP, "desc_act": desc_act, "sym": sym,
            "static_groups": False, "true_sequential": True, "damp_percent": 0.01, **kw}


def test_gptq_packing_is_sequential_along_k_and_v1_stores_zero_minus_one():
    assert int(gptq_pack(torch.arange(8).view(8, 1), 4, 0)) == 0x76543210
    assert int(gptq_pack(torch.tensor([[1, 2, 3, 4]]), 8, 1)) == 0x04030201
    # symmetric 4-bit v1: every zero is 8, stored as 7 in each nibble
    assert int(gptq_pack(torch.full((1, 8), 8 - 1), 4, 1)) == 0x77777777
    values = torch.randint(0, 16, (16, 3))
    assert torch.equal(unpack_int32(gptq_pack(values, 4, 0), 4, dim=0), values)


@pytest.mark.parametrize("bits,sym,act_order,v2,tie", [
    (4, True, False, False, False),
    (4, False, True, False, True),   # act-order: scattered groups through g_idx
    (8, False, True, True, False),   # gptq_v2 stores the zero itself
])
def test_gptq_dequantizes_exactly_and_matches_transformers(tmp_path, bits, sym, act_order, v2, tie):
    src, state = tiny_llama(tmp_path / "src", tie_word_embeddings=tie)
    stored, reference = {}, {}
    for i, m in enumerate(linear_modules(state)):
        stored[m], reference[m] = gptq_quantize(state[f"{m}.weight"], bits, sym, act_order, v2, seed=i)
    extra = {"checkpoint_format": "gptq_v2"} if v2 else {}
    qdir = quantized_dir(src, tmp_path / "gptq", stored, config(bits, sym, act_order, **extra))
    # an integer times an fp16 scale is exact in float32: exact equality
    check_weights(qdir, state, reference)
    name = f"gptq w{bits} g{GROUP}" + (" act-order" if act_order else "") + (" v2" if v2 else "")
    check_logits(qdir, dense_dir(src, tmp_path / "dense", reference), name)


def test_gptq_without_g_idx_uses_contiguous_groups(tmp_path):
    src, state = tiny_llama(tmp_path / "src")
    m = linear_modules(state)[0]
    parts, reference = gptq_quantize(state[f"{m}.weight"], 4, False, False, False, seed=0)
    del parts["g_idx"]
    got = onecat_weights(quantized_dir(src, tmp_path / "q", {m: parts}, config()))
    assert torch.equal(got[f"{m}.weight"], reference)


@pytest.mark.parametrize("override,message", [
    ({"bits": 3}, "GPTQ with bits=3 is not supported: onecat reads 2, 4, 8-bit GPTQ"),
    ({"checkpoint_format": "marlin"},
     "GPTQ checkpoint_format 'marlin' is not supported: onecat reads gptq and gptq_v2"),
    ({"is_marlin_format": True}, "GPTQ checkpoint_format 'marlin' is not supported"),
])
def test_gptq_variants_are_refused_by_name(tmp_path, override, message):
    src, _ = tiny_llama(tmp_path / "src")
    with pytest.raises(UnsupportedModelError, match=message):
        onecat_weights(quantized_dir(src, tmp_path / "q", {}, config(**override)))


def test_gptq_bad_g_idx_is_corrupt(tmp_path):
    src, state = tiny_llama(tmp_path / "src")
    m = linear_modules(state)[0]
    parts, _ = gptq_quantize(state[f"{m}.weight"], 4, False, True, False, seed=0)
    parts["g_idx"] = parts["g_idx"] + 5
    with pytest.raises(CorruptModelError, match="g_idx .* must give each of the 64 input rows a group"):
        onecat_weights(quantized_dir(src, tmp_path / "q", {m: parts}, config()))
