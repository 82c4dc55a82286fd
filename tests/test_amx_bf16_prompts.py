"""Prompt rows on AMX bfloat16 tiles (csrc/cpu/amx_bf16_matmul.cpp, EngineArgs.cpu_prompt_matmul "bf16"): the
kernel against a float64 reference, a row's bits independent of its batch, the packed layer's split of a step's
rows, the engine's use of it, and a clear refusal where the CPU has no AMX."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from onecat.engine.attention.forward_context import ForwardContext, PromptRows, set_forward_context
from onecat.engine.quant import QuantizedWeight
from onecat.engine.quant.int4 import amx_bf16, int8_matmul
from onecat.engine.quant.int4.linear import Int4PackedLinear

needs_amx = pytest.mark.skipif(amx_bf16.unavailable_reason() is not None,
                               reason=f"AMX bf16 unavailable: {amx_bf16.unavailable_reason()}")


def reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The kernel's arithmetic in float64: rows and weights rounded to bf16 (ties to even), exact products."""
    return x.to(torch.bfloat16).double() @ w.to(torch.bfloat16).double().T


@needs_amx
@pytest.mark.parametrize("m,n,k", [(1, 16, 32), (5, 48, 64), (37, 40, 576), (128, 960, 576), (300, 576, 1536)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_matches_its_reference(m, n, k, dtype):
    """Every shape the packing allows: N a multiple of 32, of 16 only (a lone last tile), of neither (padded
    columns), rows below, at and above a 32-row block; float32 rows rounded in the kernel, bf16 rows as they are."""
    g = torch.Generator().manual_seed(m + n + k)
    x, w = torch.randn(m, k, generator=g).to(dtype), torch.randn(n, k, generator=g)
    y = amx_bf16.matmul(x, amx_bf16.pack(w), n)
    assert y.shape == (m, n) and y.dtype == torch.float32
    ref = reference(x.float(), w)
    assert (y.double() - ref).abs().max().item() < 1e-5 * k


@needs_amx
def test_a_rows_result_is_the_same_alone_and_in_any_batch():
    """No row reads another: alone, permuted among 300, at any place of a 32-row block, the same bits."""
    g = torch.Generator().manual_seed(7)
    x, w = torch.randn(300, 576, generator=g), torch.randn(960, 576, generator=g)
    packed = amx_bf16.pack(w)
    y = amx_bf16.matmul(x, packed, 960)
    order = torch.randperm(300, generator=g)
    assert torch.equal(amx_bf16.matmul(x[order], packed, 960), y[order])
    for row in (0, 31, 299):
        assert torch.equal(amx_bf16.matmul(x[row:row + 1], packed, 960)[0], y[row])
    assert torch.equal(amx_bf16.matmul(x[17:50], packed, 960), y[17:50])


def test_packing_refuses_a_k_the_tiles_cannot_hold():
    with pytest.raises(ValueError, match="K % 32 == 0"):
        amx_bf16.pack(torch.zeros(16, 40))


def _q4_1_terms():
    w = np.random.default_rng(4).standard_normal((96, 256)).astype(np.float32)
    return QuantizedWeight.from_gguf("Q4_1", quants.quantize(w, GGMLQuantizationType.Q4_1), w.shape).terms


def test_prompt_rows_are_runs_of_consecutive_rows():
    assert PromptRows.of([], 4) is None
    assert PromptRows.of([0, 1, 2, 3], 4).runs == ((0, 4, True),) and PromptRows.of([0, 1, 2, 3], 4).all_prompt
    split = PromptRows.of([1, 2, 5], 7)
    assert split.runs == ((0, 1, False), (1, 3, True), (3, 5, False), (5, 6, True), (6, 7, False))
    assert not split.all_prompt


@needs_amx
def test_the_kernel_writes_into_a_row_range_of_a_larger_result():
    """`out`: a view of rows of a larger matrix (row stride of its parent); the rows around it stay untouched."""
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(45, 64, generator=g), torch.randn(48, 64, generator=g)
    packed = amx_bf16.pack(w)
    big = torch.full((60, 48), 7.0)
    amx_bf16.matmul(x, packed, 48, out=big[5:50])
    assert torch.equal(big[5:50], amx_bf16.matmul(x, packed, 48))
    assert bool((big[:5] == 7).all() and (big[50:] == 7).all())


@needs_amx
def test_the_layer_runs_prompt_rows_on_the_tiles_and_the_others_as_before():
    """A step whose rows 1-2 and 4 are prompt rows and 0, 3 are not: the prompt rows' results are the tiles' on
    the dequantized weights, the others' those of the layer without the setting (int8 dot products where they
    run)."""
    terms = _q4_1_terms()
    layer, plain = Int4PackedLinear(terms, None, prompt_matmul="bf16"), Int4PackedLinear(terms, None)
    tiles = amx_bf16.pack(Int4PackedLinear._dequantized(terms))
    x = torch.randn(5, 256)
    y = layer._prompt_split(x, PromptRows.of([1, 2, 4], 5))
    assert torch.equal(y[[1, 2, 4]], amx_bf16.matmul(x[[1, 2, 4]], tiles, 96))
    assert torch.equal(y[[0, 3]], plain(x[[0, 3]]).float())
    assert torch.equal(layer._prompt_split(x, PromptRows.of([0, 1, 2, 3, 4], 5)), amx_bf16.matmul(x, tiles, 96))
    assert not torch.equal(y[[1, 2]], plain(x[[1, 2]]).float())  # the setting changes what prompt rows run on
    assert torch.equal(layer(x), plain(x))  # outside a step with prompt rows, every row as before


@needs_amx
@pytest.mark.parametrize("rows", [[0, 1, 2, 3, 4, 5, 6], [1, 2, 5]])
def test_the_gate_up_epilogue_gives_the_unfused_bits(rows):
    """A [gate | up] layer in a step with prompt rows: SiLU(gate) * up from the tiles' epilogue (and, for the
    other rows, silu_mul over the int8 output) is exactly silu_mul over the split matmul; outside such a step
    the layer leaves the activation to its caller."""
    from onecat.engine.kernels import cpu_ops

    w = np.random.default_rng(5).standard_normal((96, 256)).astype(np.float32)
    terms = QuantizedWeight.from_gguf("Q4_1", quants.quantize(w, GGMLQuantizationType.Q4_1), w.shape).terms
    layer = Int4PackedLinear(terms, None, prompt_matmul="bf16")
    x = torch.randn(7, 256)
    prompt = PromptRows.of(rows, 7)
    assert layer.glu_prompt_rows(x) is None
    set_forward_context(ForwardContext(meta=None, kv_caches=[], attention=None, prompt_rows=prompt))
    try:
        act = layer.glu_prompt_rows(x)
    finally:
        set_forward_context(None)
    assert act.shape == (7, 48)
    assert torch.equal(act, cpu_ops.load().silu_mul(layer._prompt_split(x, prompt), False))
    layer.keep_kernel_output = True  # as the engine sets it where fused kernels run: the int8 output is float32
    set_forward_context(ForwardContext(meta=None, kv_caches=[], attention=None, prompt_rows=prompt))
    try:
        assert torch.equal(layer.glu_prompt_rows(x), act)
    finally:
        set_forward_context(None)
    # a bfloat16 model's layer rounds its output before the activation: the epilogue leaves it to the caller
    bf16_layer = Int4PackedLinear(terms, None, torch.bfloat16, prompt_matmul="bf16")
    set_forward_context(ForwardContext(meta=None, kv_caches=[], attention=None, prompt_rows=prompt))
    try:
        assert bf16_layer.glu_prompt_rows(x) is None
    finally:
        set_forward_context(None)


def test_without_amx_the_setting_is_refused_with_what_to_do(monkeypatch):
    monkeypatch.setattr(amx_bf16, "unavailable_reason", lambda: "this CPU offers no AMX-BF16 tiles")
    with pytest.raises(RuntimeError, match="no AMX-BF16 tiles.*leave cpu_prompt_matmul int8"):
        Int4PackedLinear(_q4_1_terms(), None, prompt_matmul="bf16")


@needs_amx
@pytest.mark.skipif(int8_matmul.unavailable_reason() is not None, reason="the int8 path runs the decoded rows")
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "bfloat16"])  # bfloat16: the prompt rows' attention on tiles too
def test_the_engine_runs_prompts_on_the_tiles_and_a_prompts_tokens_ignore_its_neighbours(kv_cache_dtype):
    """info() names the prompt rows' path and the layers hold the tiles (not the LM head, which scores one row a
    prompt); a prompt's greedy tokens are the same among two different sets of 16 prompts, and the same whether
    its prompt runs in one step or in chunks beside another sequence's decoding, whose tokens stay the same too."""
    from conftest import EMBEDDED

    from onecat.engine import LLM, SamplingParams

    prompts = [[1000 + (i * 131 + j * 7) % 40000 for j in range(24)] for i in range(32)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0)  # the chosen tokens' logprobs
    with LLM(EMBEDDED, device="cpu", quantization="gguf", max_model_len=256, max_num_seqs=16,
             enable_prefix_caching=False, cpu_prompt_matmul="bf16", kv_cache_dtype=kv_cache_dtype) as llm:
        assert "AMX bfloat16 tiles" in llm.info()["quantization"]["prompt_rows"]
        assert llm.info()["attention_backend"]["prompt_rows_on_tiles"]
        attention = llm.worker.attention.primary
        calls = []
        original = attention.ops.paged_attention
        attention.ops = type("Spy", (), {"paged_attention": lambda self, *a: calls.append(a[-1]) or original(*a)})()
        layers = [m for m in llm.model.modules() if isinstance(m, Int4PackedLinear)]
        assert layers and sum(m.prompt_tiles is None for m in layers) == 1  # the LM head alone keeps int8
        first = llm.generate(prompts[:16], params)[3]
        others = prompts[16:31]
        second = llm.generate(others[:9] + [prompts[3]] + others[9:], params)
        reported = llm.info()["attention_backend"]["calls_with_prompt_rows_on_tiles"]
    tiled = [c for c in calls if c is not None]  # the steps' prompt rows counted per sequence, only on a bf16 cache
    assert (len(tiled) > 0) == (kv_cache_dtype == "bfloat16") and all(int(c.sum()) > 0 for c in tiled)
    assert reported == len(tiled)
    if tiled:
        assert tiled[0].tolist() == [24] * 16  # the first step: 16 whole prompts
    assert len(first.token_ids) == 6 and first.token_ids == second[9].token_ids
    assert first.logprobs == second[9].logprobs  # the same bits, not only the same argmax
    with LLM(EMBEDDED, device="cpu", quantization="gguf", max_model_len=256, max_num_seqs=2,
             enable_prefix_caching=False, cpu_prompt_matmul="bf16", max_num_batched_tokens=16,
             kv_cache_dtype=kv_cache_dtype) as llm:
        chunked = llm.generate([prompts[20], prompts[3]], params)
    assert chunked[1].logprobs == first.logprobs  # its prompt in chunks beside the other's decoding
    assert chunked[0].logprobs == second[4].logprobs  # decoded beside the other's prompt
