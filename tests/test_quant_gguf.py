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


def test_a_rows_result_does_not_depend_on_the_rows_beside_it():
    """From DENSE_FROM_ROWS rows on, the layer runs fixed-size bf16 GEMM blocks: a row's bits are the same
    whatever its step's row count and its offset in it."""
    from onecat.engine.quant.int4.linear import DENSE_BLOCK_ROWS, DENSE_FROM_ROWS

    rng = np.random.default_rng(2)
    w = rng.standard_normal((96, 256)).astype(np.float32)
    layer = Int4PackedLinear(QuantizedWeight.from_gguf("Q4_1", quants.quantize(w, GGMLQuantizationType.Q4_1),
                                                       w.shape).terms, None)
    pool = torch.randn(80, 256)
    probe = pool[7]
    results = []
    for rows in (DENSE_FROM_ROWS, DENSE_FROM_ROWS + 1, DENSE_BLOCK_ROWS * 2 + 3, 80):
        for at in (0, rows // 2, rows - 1):
            x = pool[:rows].clone()
            x[at] = probe
            results.append(layer(x)[at])
    assert all(torch.equal(r, results[0]) for r in results)
