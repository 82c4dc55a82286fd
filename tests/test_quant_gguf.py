"""quantization='gguf': GGUF block tensors decoded exactly, packed matmuls equal dense ones, the
packed engine stays close to the dequantized reference, and misuse is refused with a clear error."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType, quants

from conftest import EMBEDDED
from onecat.engine import LLM, SamplingParams
from onecat.engine.errors import ConfigError
from onecat.engine.quant import QuantizedWeight, check_quantization
from onecat.engine.quant.int4.linear import Int4PackedLinear

pytestmark = pytest.mark.skipif(not Int4PackedLinear.supported(torch.device("cpu")),
                                reason="this torch has no CPU int4 packed matmul")


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
def test_blocks_decode_to_the_gguf_library_values(qtype):
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((48, 256)) * rng.uniform(0.01, 3, (48, 1))).astype(np.float32)
    raw = quants.quantize(w, GGMLQuantizationType[qtype])
    expected = quants.dequantize(raw, GGMLQuantizationType[qtype]).reshape(w.shape)
    got = QuantizedWeight.from_gguf(qtype, raw, w.shape).dequantize().numpy()
    assert np.allclose(got, expected, rtol=1e-6, atol=1e-6 * np.abs(expected).max())
    assert len(QuantizedWeight.from_gguf(qtype, raw, w.shape).terms) == (2 if qtype == "Q8_0" else 1)


@pytest.mark.parametrize("qtype,rows", [("Q4_1", 96), ("Q8_0", 40)])
def test_packed_linear_equals_dense_matmul_of_the_same_weights(qtype, rows):
    rng = np.random.default_rng(1)
    w = rng.standard_normal((rows, 128)).astype(np.float32)
    weight = QuantizedWeight.from_gguf(qtype, quants.quantize(w, GGMLQuantizationType[qtype]), w.shape)
    bias = torch.randn(rows)
    layer = Int4PackedLinear(weight.terms, bias)
    x = torch.randn(3, 5, 128)
    ref = F.linear(x.bfloat16().float(), weight.dequantize(), bias)  # the kernel reads bf16 activations
    out = layer(x)
    assert out.shape == (3, 5, rows) and out.dtype == torch.float32
    assert (out - ref).abs().max() <= 2e-2 * ref.abs().max()


def test_unknown_or_misplaced_quantization_is_refused():
    cpu = torch.device("cpu")
    with pytest.raises(ConfigError, match=r"^\[support matrix: int3\] quantization 'int3' is not implemented"):
        check_quantization("int3", "gguf", cpu)
    with pytest.raises(ConfigError, match="needs a .gguf checkpoint"):
        check_quantization("gguf", "hf", cpu)
    with pytest.raises(ConfigError, match="CPU only"):
        check_quantization("gguf", "gguf", torch.device("cuda"))
    check_quantization(None, "hf", torch.device("cuda"))  # unset: always fine


@pytest.fixture(scope="module")
def engines():
    kw = dict(max_model_len=512, max_num_seqs=8)
    with LLM(EMBEDDED, **kw) as dense, LLM(EMBEDDED, quantization="gguf", **kw) as packed:
        yield dense, packed


def test_packed_engine_packs_every_block_tensor_and_reports_it(engines):
    _, packed = engines
    q = packed.info()["quantization"]
    assert q["method"] == "gguf"
    assert q["packed_linears"] == {"Q4_1": 4 * 30, "Q8_0": 1}  # qkv, o, gate_up, down per layer + tied head
    assert q["dense_linears"] == []
    assert engines[0].info()["quantization"] is None


def test_packed_engine_scores_like_the_dequantized_reference(engines):
    ref, packed = engines
    text = ("The history of the printing press begins in the fifteenth century, when movable type "
            "changed how books were made and how ideas travelled across Europe. ") * 3
    a, b = ref.score([text])[0].logprobs, packed.score([text])[0].logprobs
    nll_a, nll_b = -np.mean(a), -np.mean(b)
    assert abs(nll_b - nll_a) <= 0.02 * nll_a, (nll_a, nll_b)
    # a per-token view: packed logprobs track the reference closely, they are not merely similar on average
    assert np.corrcoef(a, b)[0, 1] > 0.99


def test_packed_engine_generates_the_same_greedy_text_mostly(engines):
    ref, packed = engines
    prompts = ["The capital of France is", "Once upon a time", "1, 2, 3, 4,", "Water boils at",
               "The largest planet in the solar system is", "def add(a, b):"]
    params = SamplingParams(max_tokens=16, temperature=0.0)
    same = sum(x.token_ids == y.token_ids for x, y in zip(ref.generate(prompts, params),
                                                          packed.generate(prompts, params)))
    assert same >= len(prompts) - 2, f"only {same}/{len(prompts)} greedy continuations agree"


def test_harness_preflight_names_an_unsupported_quantization():
    from onecat.gates.contract import ArmSettings, EngineSpec, ModelSpec
    from onecat.gates.engines.onecat_engine import OnecatEngine

    def arm(quant):
        return ArmSettings(name="candidate", model=ModelSpec(source=EMBEDDED, quantization=quant),
                           engine=EngineSpec(device="cpu"))

    problems = OnecatEngine.check(arm("int3"))
    assert any("quantization 'int3'" in p and "gguf" in p for p in problems), problems
    assert OnecatEngine.check(arm("gguf")) == []


def _q4_1_layer(seed: int = 2) -> Int4PackedLinear:
    w = np.random.default_rng(seed).standard_normal((96, 256)).astype(np.float32)
    return Int4PackedLinear(QuantizedWeight.from_gguf("Q4_1", quants.quantize(w, GGMLQuantizationType.Q4_1),
                                                      w.shape).terms, None)


def test_a_rows_result_does_not_depend_on_the_rows_beside_it(monkeypatch):
    """From DENSE_FROM_ROWS rows on, the layer runs fixed-size bf16 GEMM blocks (LARGE_BLOCK_ROWS ones too,
    where this CPU gives them the same bits): a row's bits are the same whatever its step's row count and its
    offset in it."""
    from onecat.engine.quant.int4 import int8_matmul
    from onecat.engine.quant.int4.linear import DENSE_BLOCK_ROWS, DENSE_FROM_ROWS, LARGE_BLOCK_ROWS

    monkeypatch.setenv(int8_matmul.ENV, "0")  # the bf16 GEMM path (tests/test_int8_matmul.py: the other)
    layer = _q4_1_layer()
    pool = torch.randn(LARGE_BLOCK_ROWS + 44, 256)
    probe = pool[7]
    results = []
    for rows in (DENSE_FROM_ROWS, DENSE_FROM_ROWS + 1, DENSE_BLOCK_ROWS * 2 + 3, 80, LARGE_BLOCK_ROWS,
                 LARGE_BLOCK_ROWS + 44):
        for at in (0, rows // 2, rows - 1):
            x = pool[:rows].clone()
            x[at] = probe
            results.append(layer(x)[at])
    assert all(torch.equal(r, results[0]) for r in results)


@pytest.mark.parametrize("agree", [True, False])
def test_large_gemm_calls_only_where_they_give_the_small_calls_bits(monkeypatch, agree):
    """Many-row steps take LARGE_BLOCK_ROWS rows a call only when the load-time check found those calls give
    the same bits as 16-row ones; otherwise every call keeps exactly DENSE_BLOCK_ROWS rows."""
    from onecat.engine.kernels import onednn
    from onecat.engine.quant.int4 import int8_matmul, linear

    if not onednn.bf16_available():
        pytest.skip("this CPU's oneDNN has no bfloat16 linear (no AVX512BW/VL/DQ or AVX-NE-CONVERT)")
    monkeypatch.setenv(int8_matmul.ENV, "0")
    monkeypatch.setattr(linear, "_LARGE_BLOCK_CHECKS", {})
    monkeypatch.setattr(onednn, "row_count_invariant", lambda *a: agree)
    layer = _q4_1_layer()
    calls = []
    real = onednn.onednn_matmul
    monkeypatch.setattr(onednn, "onednn_matmul", lambda rows, w: calls.append(rows.shape[0]) or real(rows, w))
    x = torch.randn(linear.LARGE_BLOCK_ROWS * 2 + 20, 256)
    y = layer(x)
    expected = [linear.LARGE_BLOCK_ROWS] * 2 + [16, 16] if agree else [16] * (x.shape[0] // 16 + 1)
    assert calls == expected
    assert torch.equal(y[-20:], layer(x[-20:]))  # the tail's rows: the same bits as alone


def test_the_row_count_check_tells_kernels_apart():
    """row_count_invariant says yes when a large call computes each row as a small call does, and no when
    the large call sums K in another order (which shows in the bf16 outputs only where a sum sits near a
    rounding boundary: ~2e-4 of them at K = 512, so the check takes 256 x 256 outputs)."""
    import unittest.mock as mock

    from onecat.engine.kernels import onednn

    if not onednn.bf16_available():
        pytest.skip("this CPU's oneDNN has no bfloat16 linear (no AVX512BW/VL/DQ or AVX-NE-CONVERT)")
    w = torch.randn(256, 512).to(torch.bfloat16)
    blocked = onednn.onednn_blocked(w)
    real = onednn.onednn_matmul
    order = torch.randperm(512, generator=torch.Generator().manual_seed(1))
    reordered_weight = onednn.onednn_blocked(w[:, order])

    def row_by_row(rows, b):  # every call computes its rows 16 at a time: the same bits at any count
        return torch.cat([real(rows[i:i + 16], b) for i in range(0, rows.shape[0], 16)])

    def reordered(rows, b):  # a large call that walks K in another order
        return real(rows, b) if rows.shape[0] <= 16 else real(rows[:, order].contiguous(), reordered_weight)

    with mock.patch.object(onednn, "onednn_matmul", row_by_row):
        assert onednn.row_count_invariant(blocked, 512, 256, 16)
    with mock.patch.object(onednn, "onednn_matmul", reordered):
        assert not onednn.row_count_invariant(blocked, 512, 256, 16)
