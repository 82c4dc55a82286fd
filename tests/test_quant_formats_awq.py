"""AWQ (GEMM) checkpoints: AWQ's interleaved nibble order, exact dequantization, logits equal to
transformers' on the dequantized weights, and the variants onecat refuses."""
from __future__ import annotations

import pytest
import torch

from onecat.engine.errors import CorruptModelError, UnsupportedModelError
from onecat.engine.quant.checkpoint_formats.awq import awq_columns
from tests.quant_checkpoints import (
    KEPT_DENSE, check_logits, check_weights, dense_dir, int32_words, linear_modules, onecat_weights,
    quantized_dir, tiny_llama)

pytest.importorskip("transformers")

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ's pack order: nibble i holds column AWQ_ORDER[i]
GROUP = 32


def awq_pack(values: torch.Tensor) -> torch.Tensor:
    """[rows, N] 4-bit values -> [rows, N/8] int32, written nibble by nibble as AutoAWQ's packer does."""
    rows, n = values.shape
    acc = torch.zeros(rows, n // 8, dtype=torch.int64)
    for word in range(n // 8):
        for i in range(8):
            acc[:, word] |= values[:, word * 8 + AWQ_ORDER[i]].long() << (4 * i)
    return int32_words(acc)


def awq_quantize(weight: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Asymmetric 4-bit min-max per group of GROUP input rows: the stored parts and their exact dequantization."""
    w = weight.t().float()  # AWQ stores [K, N]
    k, n = w.shape
    g = w.view(k // GROUP, GROUP, n)
    lo, hi = g.amin(1).clamp(max=0), g.amax(1).clamp(min=0)
    scales = ((hi - lo) / 15).clamp(min=1e-4).half()
    zeros = (-lo / scales.float()).round().clamp(0, 15)
    q = (g / scales.float().unsqueeze(1) + zeros.unsqueeze(1)).round().clamp(0, 15)
    dense = ((q - zeros.unsqueeze(1)) * scales.float().unsqueeze(1)).view(k, n).t()
    stored = {"qweight": awq_pack(q.view(k, n).int()), "qzeros": awq_pack(zeros.int()), "scales": scales}
    return stored, dense.contiguous()


def config(**kw) -> dict:
    return {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True, "version": "gemm",
            "modules_to_not_convert": [KEPT_DENSE], **kw}


def test_awq_nibble_order_is_the_published_one():
    # columns 0..7 holding 0..7: nibble i (low first) holds column AWQ_ORDER[i] -> 0x75316420
    word = awq_pack(torch.arange(8).view(1, 8))
    assert int(word) == 0x75316420
    assert awq_columns(word).tolist() == [list(range(8))]
    many = torch.randint(0, 16, (5, 24))
    assert torch.equal(awq_columns(awq_pack(many)), many)


@pytest.mark.parametrize("tie", [False, True])
def test_awq_dequantizes_exactly_and_matches_transformers(tmp_path, tie):
    src, state = tiny_llama(tmp_path / "src", tie_word_embeddings=tie)
    stored, reference = {}, {}
    for m in linear_modules(state):
        stored[m], reference[m] = awq_quantize(state[f"{m}.weight"])
    qdir = quantized_dir(src, tmp_path / "awq", stored, config())
    # the writer's dequantization is exact (integer times fp16 scale in float32), so equality is exact
    check_weights(qdir, state, reference)
    check_logits(qdir, dense_dir(src, tmp_path / "dense", reference), f"awq w4 g{GROUP}")


@pytest.mark.parametrize("override,message", [
    ({"version": "gemv"}, "AWQ version 'gemv' is not supported: onecat reads AWQ's GEMM layout"),
    ({"version": "marlin"}, "AWQ version 'marlin' is not supported"),
    ({"bits": 8}, "AWQ with bits=8 is not supported: onecat reads 4-bit AWQ"),
    ({"zero_point": False}, "AWQ with zero_point=false is not supported"),
])
def test_awq_variants_are_refused_by_name(tmp_path, override, message):
    src, _ = tiny_llama(tmp_path / "src")
    qdir = quantized_dir(src, tmp_path / "q", {}, config(**override))
    with pytest.raises(UnsupportedModelError, match=message):
        onecat_weights(qdir)


def test_awq_incomplete_or_misshapen_linears_are_corrupt(tmp_path):
    src, state = tiny_llama(tmp_path / "src")
    m = linear_modules(state)[0]
    parts, _ = awq_quantize(state[f"{m}.weight"])
    missing = {k: v for k, v in parts.items() if k != "qzeros"}
    with pytest.raises(CorruptModelError, match=f"{m} has no qzeros"):
        onecat_weights(quantized_dir(src, tmp_path / "a", {m: missing}, config()))
    bad = {**parts, "scales": parts["scales"][:, :-8]}
    with pytest.raises(CorruptModelError, match="are not AWQ's"):
        onecat_weights(quantized_dir(src, tmp_path / "b", {m: bad}, config()))
    with pytest.raises(CorruptModelError, match="group_size is 64"):
        onecat_weights(quantized_dir(src, tmp_path / "c", {m: parts}, config(group_size=64)))
