"""Tensor parallel on the hybrid models (Qwen3.5, Qwen3.5-MoE) on CPU (gloo, one process per rank): Gated DeltaNet
sharded by heads (whole key heads with their value heads; a key head replicated when there are more ranks than
key heads), the gated attention by heads with each head's gate, MLPs, shared experts and experts by units, the
recurrent state cache sized by the local heads. Prompt logprobs equal TP=1's to float32 summation order and
greedy tokens equal, from HF checkpoints (plain, multimodal `model.language_model.`) and a GGUF file (fused q/k/v,
stacked experts), and with prefix caching (mamba_cache_mode align: rank 0 decides the snapshots, the other
ranks repeat its copies) and preemption."""
from __future__ import annotations

from pathlib import Path

import pytest

from onecat.engine import LLM, SamplingParams
from tests.test_tensor_parallel import assert_tp_scores_as_tp1
from tests.tiny_moe_hybrid import make_tiny_moe_hybrid

pytest.importorskip("transformers")

TEXT = ["t1 t5 t9 t33 t70 t2", "t4 t4 t8 t100 t200 t3 t7 t11 t12 t13 t14 t15"]


def _check_tp2(moe: bool):
    def check(llm):
        info = llm.info()["tensor_parallel"]
        assert info["linear_heads"] == [{"value": [0, 1], "key": [0]}, {"value": [2, 3], "key": [1]}]
        deltanet, attn = llm.model.layers[0].linear_attn, llm.model.layers[1].self_attn
        # tiny: 2 key / 4 value heads of 16 dims; 4 query / 2 KV heads of 32 dims (query and gate per head)
        assert (deltanet.k_heads, deltanet.v_heads) == (1, 2)
        assert deltanet.in_proj.weight.shape == (2 * 16 + 2 * 16 + 2 * 16 + 2 + 2, 64)
        assert deltanet.conv1d.weight.shape[0] == 16 + 16 + 32 and deltanet.A_log.shape == (2,)
        assert deltanet.out_proj.weight.shape == (64, 32)
        assert llm.model.states.ssm.shape[2:] == (2, 16, 16) and llm.model.states.conv.shape[2] == 64
        assert (attn.num_heads, attn.num_kv_heads) == (2, 1) and attn.qkv_proj.weight.shape == (2 * 64 + 2 * 32, 64)
        if moe:
            mlp = llm.model.layers[0].mlp
            assert mlp.experts.intermediate == 24 and mlp.shared_expert.intermediate == 20
    return check


@pytest.mark.parametrize("arch", [pytest.param("qwen3_5", marks=pytest.mark.slow), "qwen3_5_moe"])
def test_hybrid_tp2_scores_as_tp1(tmp_path, arch):
    model_dir = make_tiny_moe_hybrid(arch, tmp_path / arch, tie_word_embeddings=False)
    assert_tp_scores_as_tp1(model_dir, 2, TEXT, _check_tp2(arch == "qwen3_5_moe"))


@pytest.mark.slow
def test_multimodal_checkpoint_shards_as_the_text_one(tmp_path):
    """The published layout (text model under `model.language_model.`, a vision tower the engine skips)."""
    assert_tp_scores_as_tp1(make_tiny_moe_hybrid("qwen3_5_vl", tmp_path / "vl"), 2, TEXT)


@pytest.mark.slow
def test_gguf_with_fused_qkv_and_stacked_experts_shards_as_tp1():
    """llama.cpp's qwen35moe file (--fuse-qkv --fuse-gate-up-exps, value heads re-tiled on load), read dequantized:
    2 query heads over 1 KV head, so each rank holds one query head and a copy of the KV head."""
    pytest.importorskip("gguf")
    path = Path(__file__).parent / "data" / "tiny-qwen35moe-fused.gguf"
    assert_tp_scores_as_tp1(path, 2, [[1, 5, 9, 33, 70, 2], [4, 4, 8, 100, 20, 3, 7, 11, 12]])  # token ids


@pytest.mark.slow
def test_tp3_replicates_key_heads_and_splits_their_value_heads(tmp_path):
    """3 ranks over 2 key heads: ranks 0 and 1 share key head 0 (one value head each), rank 2 has key head 1 and
    both its value heads; the attention's 2 KV heads are replicated likewise."""
    def check(llm):
        assert llm.info()["tensor_parallel"]["linear_heads"] == [
            {"value": [0], "key": [0]}, {"value": [1], "key": [0]}, {"value": [2, 3], "key": [1]}]

    assert_tp_scores_as_tp1(make_tiny_moe_hybrid("qwen3_5", tmp_path / "h"), 3, TEXT, check)


PROMPTS = [list(range(10, 47)), [5, 17, 99, 3], list(range(100, 160)), [200, 7], list(range(300, 319))]


def test_tp2_align_prefix_hits_and_preemption_keep_tp1_tokens(tmp_path):
    """mamba_cache_mode align under TP=2 with a small KV cache: requests are preempted and resume from saved
    states, and the same prompts again hit the prefix cache and restore saved states, on every rank (a rank
    that missed a copy would give other tokens: the slow-decay model leans on its state)."""
    model_dir = make_tiny_moe_hybrid("qwen3_5", tmp_path / "h", slow_decay=True)
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    with LLM(str(model_dir), dtype="float32", max_model_len=96) as base:
        reference = [o.token_ids for o in base.generate(PROMPTS, greedy)]
    with LLM(str(model_dir), dtype="float32", max_model_len=96, max_num_batched_tokens=8, block_size=4,
             num_kv_blocks=26, max_num_seqs=4, mamba_cache_mode="align", tensor_parallel_size=2) as llm:
        first = llm.generate(PROMPTS, greedy)
        assert llm.engine.scheduler.num_preemptions > 0
        restored = llm.model.states.restored
        again = llm.generate(PROMPTS, greedy)
        assert llm.model.states.restored > restored > 0
        assert all(llm.tp.workers.alive())
    assert [o.token_ids for o in first] == reference
    assert [o.token_ids for o in again] == reference
    assert sum(o.num_cached_tokens for o in again) > 0


@pytest.mark.slow
def test_tp2_speculation_with_align_keeps_tp1_tokens(tmp_path):
    """n-gram speculation with mamba_cache_mode align under TP=2: every rank saves (repeating rank 0's copies) only
    states after accepted tokens, so the first round and the prompts extending it (prefix hits into the
    generated blocks) give TP=1's plain tokens."""
    model_dir = make_tiny_moe_hybrid("qwen3_5", tmp_path / "h", slow_decay=True)
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    with LLM(str(model_dir), dtype="float32", max_model_len=128) as base:
        reference = [o.token_ids for o in base.generate(PROMPTS, greedy)]
        second = [p + t for p, t in zip(PROMPTS, reference)]
        second_ref = [o.token_ids for o in base.generate(second, greedy)]
    with LLM(str(model_dir), dtype="float32", max_model_len=128, block_size=4, mamba_cache_mode="align",
             tensor_parallel_size=2, speculative_config={"method": "ngram", "num_speculative_tokens": 7}) as llm:
        first = llm.generate(PROMPTS, greedy)
        again = llm.generate(second, greedy)
        assert llm.model.states.restored > 0 and llm.model.states.rollbacks > 0
        assert all(llm.tp.workers.alive())
    assert [o.token_ids for o in first] == reference
    assert [o.token_ids for o in again] == second_ref
    assert any(o.num_cached_tokens > len(p) for o, p in zip(again, PROMPTS))


@pytest.mark.slow
def test_tp2_speculation_rolls_every_ranks_state_back(tmp_path):
    """n-gram speculation on a hybrid model under TP=2: each rank keeps its heads' intermediate states of a verify
    chunk and rolls back to the accepted tokens, so the tokens are TP=1's."""
    model_dir = make_tiny_moe_hybrid("qwen3_5", tmp_path / "h", slow_decay=True)
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    prompts = [[7, 8, 9, 10, 7, 8, 9, 10, 7, 8, 9], PROMPTS[0]]
    with LLM(str(model_dir), dtype="float32", max_model_len=96) as base:
        reference = [o.token_ids for o in base.generate(prompts, greedy)]
    with LLM(str(model_dir), dtype="float32", max_model_len=96, tensor_parallel_size=2,
             speculative_config={"method": "ngram", "num_speculative_tokens": 3}) as llm:
        outs = llm.generate(prompts, greedy)
        assert llm.model.states.rollbacks > 0
    assert [o.token_ids for o in outs] == reference
