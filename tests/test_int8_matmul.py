"""The packed layers' int8 many-row matmul (csrc/cpu/int8_matmul.cpp): exact against an integer reference,
row-independent, and the layer's path where it runs."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from onecat.engine.quant import QuantizedWeight
from onecat.engine.quant.int4 import int8_matmul
from onecat.engine.quant.int4.layout import Int4Blocks
from onecat.engine.quant.int4.linear import DENSE_FROM_ROWS, Int4PackedLinear

needs_int8 = pytest.mark.skipif(int8_matmul.unavailable_reason() is not None,
                                reason=f"int8 matmul unavailable: {int8_matmul.unavailable_reason()}")
needs_vnni = pytest.mark.skipif(int8_matmul.isa() != "AVX512-VNNI", reason="the AVX2 kernel is compared with "
                                "the AVX512-VNNI one on a CPU that has both")


def reference(x: torch.Tensor, blocks: Int4Blocks) -> torch.Tensor:
    """The kernel's arithmetic in float64: activations rounded to int8 per 32 values (ties to even), exact
    integer block sums, bf16-rounded scale and zero."""
    x = x.float()
    m, k = x.shape
    xb = x.view(m, k // 32, 32)
    amax = xb.abs().amax(2, keepdim=True)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    qa = torch.round(xb * inv).clamp(-127, 127).double()
    d = (amax / 127)[..., 0].double()
    s = blocks.scale.to(torch.bfloat16).double()
    c = blocks.zero.to(torch.bfloat16).double() - 8 * s
    q = blocks.codes.double().view(blocks.shape[0], k // 32, 32)
    dots = torch.einsum("mbk,nbk->mnb", qa, q)
    return (dots * s[None] * d[:, None]).sum(2) + (c[None] * (d * qa.sum(2))[:, None]).sum(2)


def random_blocks(n: int, k: int, seed: int = 0) -> Int4Blocks:
    g = torch.Generator().manual_seed(seed)
    return Int4Blocks(torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g),
                      torch.rand(n, k // 32, generator=g) * 0.02, torch.randn(n, k // 32, generator=g) * 0.05)


@needs_int8
@pytest.mark.parametrize("n,k,m", [(40, 64, 3), (96, 576, 16), (576, 1536, 37), (960, 576, 300)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_matmul_matches_its_integer_reference(n, k, m, dtype):
    blocks = random_blocks(n, k)
    x = torch.randn(m, k).to(dtype)
    x[0, :32] = 0  # an all-zero block: scale 0, no division by it
    y = int8_matmul.Int8MatmulWeights(blocks)(x)
    ref = reference(x, blocks)
    assert y.shape == (m, n) and y.dtype == torch.float32
    assert ((y.double() - ref).abs().max() / ref.abs().max()).item() < 2e-6


@needs_vnni
@pytest.mark.parametrize("n,k,m", [(40, 64, 3), (200, 576, 16), (568, 1536, 37), (96, 576, 130)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_three_kernels_give_the_same_bits(n, k, m, dtype):
    """Same integer block sums, same float operations per column in the same order (the compact layout's offset
    formed to the byte layout's bits): AVX512-VNNI on either layout and AVX2 on the compact one agree, so a
    machine's results do not depend on which kernel its CPU has."""
    blocks = random_blocks(n, k, seed=5)
    x = torch.randn(m, k).to(dtype)
    x[1, 32:64] = 0
    compact, wide = int8_matmul.Int8MatmulWeights(blocks, "compact"), int8_matmul.Int8MatmulWeights(blocks, "bytes")
    assert torch.equal(compact(x), wide(x))
    assert torch.equal(compact(x, "avx2"), wide(x))


@needs_int8
def test_a_rows_int8_result_is_the_same_alone_and_in_any_batch():
    blocks = random_blocks(200, 576, seed=3)
    weights = int8_matmul.Int8MatmulWeights(blocks)
    pool = torch.randn(300, 576).to(torch.bfloat16)
    probe = weights(pool[5:6])[0]
    for rows, at in ((16, 0), (17, 9), (129, 128), (300, 5)):
        x = pool[:rows].clone()
        x[at] = pool[5]
        assert torch.equal(weights(x)[at], probe)


@needs_int8
def test_extreme_activations_stay_exact():
    """Codes of 15 against activations of +-127 in every position: the AVX2 kernel's int16 partial sums reach
    their largest (8 words x 2 x 15 x 127 = 30,480) and must not saturate or wrap."""
    n, k = 24, 256
    blocks = Int4Blocks(torch.full((n, k), 15, dtype=torch.uint8), torch.full((n, k // 32), 0.01),
                        torch.zeros(n, k // 32))
    x = torch.ones(3, k)
    x[1] = -1.0
    x[2, ::2] = -1.0
    y = int8_matmul.Int8MatmulWeights(blocks)(x)
    assert ((y.double() - reference(x, blocks)).abs().max()).item() < 1e-4


def _q4_1_terms() -> list[Int4Blocks]:
    w = np.random.default_rng(4).standard_normal((96, 256)).astype(np.float32)
    return QuantizedWeight.from_gguf("Q4_1", quants.quantize(w, GGMLQuantizationType.Q4_1), w.shape).terms


def _q4_1_layer() -> Int4PackedLinear:
    return Int4PackedLinear(_q4_1_terms(), None)


@needs_int8
def test_the_packed_layer_runs_every_row_count_on_int8():
    """Where the int8 kernel runs, a packed layer's rows all take it (no bf16 copy, no 4-bit kernel): a row's bits
    do not depend on its batch."""
    layer = _q4_1_layer()
    assert layer.int8 is not None and layer.dense_blocked is None  # no bf16 copy kept
    assert layer.input_dtype == torch.float32  # producers hand it float32 rows to round to int8
    x = torch.randn(DENSE_FROM_ROWS + 3, 256)
    for rows in (1, 3, DENSE_FROM_ROWS - 1, DENSE_FROM_ROWS + 3):
        assert torch.equal(layer(x[:rows]), layer.int8(x[:rows]))
    assert torch.equal(layer(x[:1])[0], layer(x)[0])


def _q8_0_layer() -> tuple[Int4PackedLinear, np.ndarray]:
    w = np.random.default_rng(6).standard_normal((96, 256)).astype(np.float32)
    return Int4PackedLinear(QuantizedWeight.from_gguf("Q8_0", quants.quantize(w, GGMLQuantizationType.Q8_0),
                                                      w.shape).terms, None), w


@needs_vnni
def test_a_q8_0_layer_is_one_eight_bit_term_with_avx512_vnni():
    """Q8_0's two 4-bit terms run as one term of 8-bit codes (q + 128) in the byte layout: exact integer block
    sums against an integer reference over the file's int8 values, the same at every row count."""
    layer, w = _q8_0_layer()
    assert layer.num_terms == 2 and isinstance(layer.int8, int8_matmul.Int8MatmulWeights)
    assert layer.int8.layout == "q8" and layer.int8.offsets.numel() == 0  # 1.06 bytes a weight, no offsets
    hi, lo = layer_terms = _q8_terms(w)
    assert int8_matmul.one_eight_bit_term(layer_terms)
    q = 16 * (hi.codes.int() - 8) + lo.codes.int()  # the file's int8 values
    assert int(q.min()) >= -128 and int(q.max()) <= 127
    eight_bit = Int4Blocks(torch.zeros_like(lo.codes), lo.scale, torch.zeros_like(lo.scale))  # w = d * q
    x = torch.randn(20, 256)
    ref = _reference_codes(x, q.double(), eight_bit)
    assert ((layer(x).double() - ref).abs().max() / ref.abs().max()).item() < 2e-6
    assert torch.equal(layer(x[3:4])[0], layer(x)[3])  # row-independent
    assert not int8_matmul.one_eight_bit_term([hi, random_blocks(96, 256)])  # not Q8_0's split: two products


@needs_vnni
@pytest.mark.parametrize("n", [96, 80])  # tiles in pairs; an odd last tile alone
def test_the_q8_layout_gives_the_bits_of_stored_offsets(n):
    """The q8 layout forms each block's offset (-128 x scale) instead of reading it: the same bits as the byte
    layout holding those offsets in float32, at every row count."""
    w = np.random.default_rng(7).standard_normal((n, 256)).astype(np.float32)
    q8 = int8_matmul.Int8MatmulWeights.eight_bit(*_q8_terms(w))
    stored = int8_matmul.Int8MatmulWeights(Int4Blocks(torch.zeros(n, 256, dtype=torch.uint8), torch.ones(n, 8),
                                                      torch.zeros(n, 8)), "bytes")
    stored.codes, stored.scales = q8.codes, q8.scales.float()
    stored.offsets = -128 * stored.scales
    assert q8.scales.dtype == torch.bfloat16 and stored.offsets.abs().max() > 0
    x = torch.randn(11, 256)
    for rows in (1, 2, 5, 11):
        assert torch.equal(q8(x[:rows]), stored(x[:rows]))
    assert torch.equal(q8(x.to(torch.bfloat16)), stored(x.to(torch.bfloat16)))


@pytest.mark.parametrize("layout", ["compact", "q8"])
def test_dense_rows_are_the_weights_the_kernel_computes_with(layout):
    """A few rows of a packed layer unpacked from its layout (a drafter's draft vocabulary over a packed LM head)
    are exactly its dequantized weights (bf16-rounded scales and zeros), with no dense copy of the whole layer."""
    if int8_matmul.isa() is None:
        pytest.skip("the int8 layouts are packed where the int8 kernel runs")
    ids = torch.tensor([0, 5, 17, 40, 95])
    if layout == "q8":
        if int8_matmul.isa() != "AVX512-VNNI":
            pytest.skip("Q8_0 runs as one 8-bit term with AVX512-VNNI")
        hi, lo = _q8_terms(np.random.default_rng(8).standard_normal((96, 256)).astype(np.float32))
        weights = int8_matmul.Int8MatmulWeights.eight_bit(hi, lo)
        want = Int4PackedLinear._dequantized([hi, lo])[ids]
    else:
        blocks = random_blocks(96, 256, seed=9)
        weights = int8_matmul.Int8MatmulWeights(blocks)
        want = Int4PackedLinear._dequantized([blocks])[ids]
    assert torch.equal(weights.dense_rows(ids), want)


def _q8_terms(w: np.ndarray) -> list[Int4Blocks]:
    return QuantizedWeight.from_gguf("Q8_0", quants.quantize(w, GGMLQuantizationType.Q8_0), w.shape).terms


def _reference_codes(x: torch.Tensor, q: torch.Tensor, blocks: Int4Blocks) -> torch.Tensor:
    """reference() with signed codes q and no zero: w = scale * q."""
    m, k = x.shape
    xb = x.float().view(m, k // 32, 32)
    amax = xb.abs().amax(2, keepdim=True)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    qa = torch.round(xb * inv).clamp(-127, 127).double()
    d = (amax / 127)[..., 0].double()
    s = blocks.scale.to(torch.bfloat16).double()
    dots = torch.einsum("mbk,nbk->mnb", qa, q.view(q.shape[0], k // 32, 32))
    return (dots * s[None] * d[:, None]).sum(2)


@needs_int8
def test_a_q8_0_layer_sums_its_two_terms_products_on_avx2():
    """On AVX2 (no VNNI: VPMADDUBSW would saturate on 8-bit codes) each term's int8 product, summed in term order."""
    if int8_matmul.isa() != "AVX2":
        pytest.skip("AVX512-VNNI runs Q8_0 as one 8-bit term")
    layer, w = _q8_0_layer()
    x = torch.randn(20, 256)
    parts = [t(x) for t in layer.int8.terms]
    assert torch.equal(layer(x), parts[0] + parts[1])
    assert torch.equal(layer(x[3:4])[0], layer(x)[3])  # row-independent
    ref = torch.from_numpy(w) @ x.T
    assert ((layer(x).T - ref).abs().max() / ref.abs().max()).item() < 0.02  # int8 activations, 8-bit weights


def test_the_switch_turns_the_int8_path_off(monkeypatch):
    monkeypatch.setenv(int8_matmul.ENV, "0")
    assert int8_matmul.unavailable_reason() == f"{int8_matmul.ENV}=0"
    layer = _q4_1_layer()
    assert layer.int8 is None
    assert "int8 dot products off" in Int4PackedLinear.large_batch_path()
    if Int4PackedLinear.supported(torch.device("cpu")):  # the 4-bit kernel and the bf16 GEMM then take the rows
        x = torch.randn(DENSE_FROM_ROWS + 2, 256)
        for rows in (1, DENSE_FROM_ROWS + 2):
            ref = x[:rows].to(torch.bfloat16).float() @ layer._dequantized(_q4_1_terms()).to(torch.bfloat16).float().T
            torch.testing.assert_close(layer(x[:rows]), ref, rtol=1e-2, atol=0.1)  # bf16 outputs of ~16


@needs_int8
def test_the_engine_says_its_packed_layers_run_int8_and_a_prompts_tokens_ignore_its_neighbours():
    """info() names the path; a prompt's greedy tokens are the same among two different sets of 16 prompts
    (every step of 16 sequences runs its rows on int8, each row's result independent of the others)."""
    from conftest import EMBEDDED

    from onecat.engine import LLM, SamplingParams
    from onecat.reports.compare import _isa_cell

    with LLM(EMBEDDED, device="cpu", quantization="gguf", max_model_len=256, max_num_seqs=16,
             enable_prefix_caching=False) as llm:
        info = llm.info()
        isa = int8_matmul.isa()
        assert info["cpu_isa"]["int8_matmul"].startswith(f"{isa} (")
        assert f"int8 dot products on the 4-bit codes ({isa}" in info["quantization"]["large_batch_path"]
        assert f"int8 matmul {isa}" in _isa_cell(info["cpu_isa"])
        prompts = [[1000 + (i * 131 + j * 7) % 40000 for j in range(24)] for i in range(32)]
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        first = llm.generate(prompts[:16], params)[3].token_ids
        others = prompts[16:31]
        second = llm.generate(others[:9] + [prompts[3]] + others[9:], params)[9].token_ids
    assert len(first) == 6 and first == second
