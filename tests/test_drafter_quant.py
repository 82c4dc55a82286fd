"""A DFlash drafter quantized at load (speculative_config quantization, engine/speculative/drafter_quant.py): its
linears become packed layers of the format (those the format cannot take stay dense and are listed), the stacked
projections of the drafting path equal the per-layer ones, its forward stays close to the dense drafter's, and
with the engine's verifier the output is the target's, token for token."""
from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch import nn

from onecat.engine.config import ModelConfig
from onecat.engine.speculative import dflash_fused
from onecat.engine.speculative.drafter_quant import FORMATS, quantize_drafter


def _drafter():
    from onecat.engine.random_models import shape_config
    from onecat.training.drafter import drafter_config, new_drafter

    mc = ModelConfig.from_hf(shape_config("tiny-llama"))  # widths of 64 and more: every format's blocks fit
    cfg = drafter_config(mc, block_size=4, layer_ids=[0, 1, 3], num_layers=2, intermediate_size=None, mask_token_id=0)
    return new_drafter(cfg, 64, torch.device("cpu"), seed=3).eval()


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0).item()


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantized_drafter_packs_its_linears_and_stays_close_to_the_dense_one(fmt):
    dense = _drafter()
    drafter = copy.deepcopy(dense)
    report = quantize_drafter(drafter, fmt)
    linears = [n for n, m in dense.named_modules() if isinstance(m, nn.Linear)]
    left = sorted(n for n, m in drafter.named_modules() if isinstance(m, nn.Linear))
    assert report["format"] == fmt and report["packed_linears"] + len(report["kept_dense"]) == len(linears)
    assert sorted(report["kept_dense"]) == left  # what stays dense is said, and nothing else is
    assert report["kept_dense"] == [] and report["stacked"] == {"qkv": True, "context_kv": True}
    torch.manual_seed(0)
    h = dense.cfg["hidden_size"]
    feats = torch.randn(2, 6, len(dense.target_layer_ids) * h)
    block = torch.randn(2, 4, h)
    ctx_pos, block_pos = torch.arange(6).expand(2, 6), torch.arange(6, 10).expand(2, 4)
    with torch.no_grad():
        want = dense.forward_blocks(block, block_pos, dense.context(feats), ctx_pos, torch.tensor([6, 4]))
        got = drafter.forward_blocks(block, block_pos, drafter.context(feats), ctx_pos, torch.tensor([6, 4]))
    assert got.shape == want.shape and _cosine(got, want) > (0.995 if fmt == "fp8" else 0.9), fmt


def test_a_w4a16_drafter_on_the_cpu_runs_in_the_packed_4_bit_layer():
    """On the CPU a W4A16 drafter's linears (the stacked ones too) are the int4 layer the CPU's packed targets
    use (int8 dot products where the CPU has them), not the GPU layer reading its weights dequantized: on a
    2-vCPU Xeon a DFlash round of the packed embedded target went 17.7 -> 11.9 ms."""
    from onecat.engine.quant.int4.linear import Int4PackedLinear

    drafter = _drafter()
    quantize_drafter(drafter, "w4a16")
    packed = [m for m in drafter.modules() if isinstance(m, Int4PackedLinear)]
    attn = drafter.layers[0].self_attn
    assert attn.o_proj in packed and attn.qkv_packed in packed and drafter.kv_packed in packed


def test_stacked_packed_projections_equal_the_per_layer_ones():
    drafter = _drafter()
    quantize_drafter(drafter, "fp8")
    torch.manual_seed(1)
    ctx = torch.randn(2, 5, drafter.cfg["hidden_size"])
    pos = torch.arange(5).expand(2, 5)
    with torch.no_grad():
        stacked = drafter.context_kv(ctx, pos)  # every layer's k/v in one packed call
    with torch.enable_grad():
        per_layer = drafter.context_kv(ctx, pos)  # each layer's packed k_proj / v_proj
    for (k1, v1), (k2, v2) in zip(stacked, per_layer):
        torch.testing.assert_close(k1, k2.detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(v1, v2.detach(), rtol=1e-5, atol=1e-6)
    layer = drafter.layers[0]
    x = torch.randn(3, drafter.cfg["hidden_size"])
    with torch.no_grad():
        qkv, residual = dflash_fused._qkv(layer, x, None)  # the fused drafting path's one call
        h = layer.input_layernorm(x)
        attn = layer.self_attn
        torch.testing.assert_close(qkv, torch.cat([attn.q_proj(h), attn.k_proj(h), attn.v_proj(h)], -1),
                                   rtol=1e-5, atol=1e-6)
    assert torch.equal(residual, x)


def test_unknown_format_and_methods_that_ignore_it_are_refused():
    from onecat.engine.args import SpeculativeConfig

    with pytest.raises(ValueError, match="expected one of"):
        quantize_drafter(_drafter(), "int3")
    with pytest.raises(ValueError, match="only a drafter model"):
        SpeculativeConfig(method="ngram", num_speculative_tokens=3, quantization="fp8")
    SpeculativeConfig(method="synthetic", compute="dflash", acceptance_length=2.0, num_speculative_tokens=3,
                      quantization="nvfp4")


def test_the_engine_keeps_the_targets_tokens_with_a_quantized_drafter(tmp_path):
    """Through the engine on the tiny Qwen3.5 (a random drafter of its shape, FP8: its widths are too narrow for the
    FP4 GEMV's 64-column blocks): target-only's tokens, and the proposer says what it packed."""
    from onecat.engine import LLM
    from tests.test_dflash_hybrid import PROMPTS, dflash, greedy, make_drafter, target_config

    drafters = {"tiny-qwen35": make_drafter(target_config("tiny-qwen35"), tmp_path / "d", seed=0)}
    target = str(Path(__file__).parent / "data" / "tiny-qwen35")
    with LLM(target, max_model_len=128) as llm:
        want = [o.token_ids for o in llm.generate(PROMPTS, greedy())]
    with LLM(target, max_model_len=128, speculative_config={**dflash(drafters, "tiny-qwen35"),
                                                            "quantization": "fp8"}) as llm:
        outs = llm.generate(PROMPTS, greedy())
        info = llm.info()["speculative"]
    assert [o.token_ids for o in outs] == want and all(o.spec.num_drafts > 0 for o in outs)
    assert info["quantization"]["format"] == "fp8" and info["quantization"]["kept_dense"] == [], info


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_the_engine_keeps_the_targets_tokens_with_a_quantized_trained_drafter(fmt, embedded_llm):
    from onecat.engine import LLM, SamplingParams
    from tests.conftest import EMBEDDED
    from tests.test_speculative import CHAT_QUESTIONS, TRAINED_DFLASH

    if not (TRAINED_DFLASH / "model.safetensors").is_file():
        pytest.skip("the trained drafter is not in this install")
    prompts = [[{"role": "user", "content": q}] for q in CHAT_QUESTIONS[:2]]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    want = [o.token_ids for o in embedded_llm.chat(prompts, params)]
    spec = {"method": "dflash", "model": "embedded:smollm2-135m-dflash", "num_speculative_tokens": 7,
            "quantization": fmt, "disable_when_slower": False}
    with LLM(EMBEDDED, max_model_len=512, speculative_config=spec) as llm:
        outs = llm.chat(prompts, params)
        info = llm.info()["speculative"]
    assert [o.token_ids for o in outs] == want
    assert info["quantization"]["format"] == fmt and info["quantization"]["packed_linears"] > 0, info
    drafts = sum(o.spec.num_drafts for o in outs)
    acceptance = 1 + sum(o.spec.num_accepted_tokens for o in outs) / drafts
    assert acceptance > 1.3, f"acceptance length {acceptance:.2f} of the {fmt} drafter"  # random drafts give ~1.0


def test_a_drafter_too_narrow_for_the_format_stays_dense_and_says_so():
    import json
    from pathlib import Path

    from onecat.training.drafter import drafter_config, new_drafter

    data = Path(__file__).parent / "data" / "tiny-qwen35" / "config.json"
    mc = ModelConfig.from_hf(json.loads(data.read_text()))  # hidden 32: no FP4 GEMV takes K = 32 (needs 64s)
    cfg = drafter_config(mc, block_size=4, layer_ids=[0, 1, 3], num_layers=1, intermediate_size=None,
                         mask_token_id=0)
    dense = new_drafter(cfg, 64, torch.device("cpu"), seed=5).eval()
    drafter = copy.deepcopy(dense)
    report = quantize_drafter(drafter, "nvfp4")
    assert report["packed_linears"] == 0 and len(report["kept_dense"]) == 7  # q, k, v, o, gate_up, down, fc
    assert report["stacked"] == {"qkv": False, "context_kv": False}
    ctx, pos = torch.randn(1, 5, 32), torch.arange(5).expand(1, 5)
    with torch.no_grad():
        for (k1, v1), (k2, v2) in zip(drafter.context_kv(ctx, pos), dense.context_kv(ctx, pos)):
            assert torch.equal(k1, k2) and torch.equal(v1, v2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_a_quantized_drafter_drafts_through_its_cuda_graphs_and_keeps_the_tokens(fmt):
    """On a GPU with cuda_graph full and the fused kernels, a random target of the tiny Llama shape (widths of 64:
    every format's blocks fit) with a random drafter of its shape: the drafter's rounds replay its graphs through
    the packed layers, and the tokens are target-only's."""
    from onecat.engine import LLM, SamplingParams
    from onecat.engine.random_models import shape_config
    from onecat.engine.speculative.random_drafter import random_dflash_drafter

    drafter = random_dflash_drafter(ModelConfig.from_hf(shape_config("tiny-llama")), 5)
    settings = dict(device="cuda", dtype="bfloat16", cuda_graph="full", max_model_len=256, max_num_seqs=4,
                    load_format="dummy_peaked")
    prompts = [[5, 6, 7, 8] * 8, list(range(10, 50))]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    with LLM("random:tiny-llama", **settings) as llm:
        want = [o.token_ids for o in llm.generate(prompts, params)]
    spec = {"method": "dflash", "model": str(drafter), "num_speculative_tokens": 4, "quantization": fmt,
            "disable_when_slower": False}
    with LLM("random:tiny-llama", speculative_config=spec, **settings) as llm:
        outs = llm.generate(prompts, params)
        info = llm.info()["speculative"]
    assert [o.token_ids for o in outs] == want
    assert info["quantization"]["kept_dense"] == [] and info["cuda_graph_replays"] > 0, info


def test_a_draft_model_quantized_at_load_keeps_the_targets_tokens():
    """Method draft_model with quantization: the draft engine loads its model quantized (here the tiny Qwen3.5
    drafting for itself, W4A16 on the CPU); its drafts mostly agree with the dense target's, and the output is the
    target's."""
    from onecat.engine import LLM, SamplingParams

    path = str(Path(__file__).parent / "data" / "tiny-qwen35")
    prompts = [[5, 6, 7, 8] * 6, list(range(10, 47))]
    greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    with LLM(path, max_model_len=128) as llm:
        want = [o.token_ids for o in llm.generate(prompts, greedy)]
    spec = {"method": "draft_model", "model": path, "num_speculative_tokens": 3, "quantization": "w4a16",
            "disable_when_slower": False}
    with LLM(path, max_model_len=128, speculative_config=spec) as llm:
        outs = llm.generate(prompts, greedy)
        described = llm.info()["speculative"]
        draft_quant = llm.engine.proposer.proposer.draft.info()["quantization"]
    assert [o.token_ids for o in outs] == want
    assert described["quantization"] == "w4a16" and draft_quant["method"] == "w4a16" and draft_quant["packed_linears"]
    assert sum(o.spec.num_accepted_tokens for o in outs) > 0
