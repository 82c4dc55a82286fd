"""The recurrent state of hybrid models (Qwen3.5) in the engine: the chunked and recurrent forms of the gated
delta rule agree, state slots follow requests through preemption (recomputed from position 0), prefix-cache
hits restore a state saved at a block boundary (mamba_cache_mode align) and give the tokens of no hit, and
the settings the engine cannot honour for hybrid models are refused or said."""
from __future__ import annotations

import logging

import pytest
import torch

from tests.tiny_moe_hybrid import make_tiny_moe_hybrid

pytest.importorskip("transformers")

PROMPTS = [list(range(10, 47)), [5, 17, 99, 3], list(range(100, 160)), [200, 7], list(range(300, 319))]


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory):
    return make_tiny_moe_hybrid("qwen3_5", tmp_path_factory.mktemp("hybrid") / "qwen3_5")


def greedy(n=12):
    from onecat.engine import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


@pytest.mark.parametrize("n,chunk", [(1, 64), (5, 4), (70, 64), (33, 16)])
def test_chunked_delta_rule_equals_token_by_token(n, chunk):
    from onecat.engine.layers import gated_deltanet_ops as ops

    torch.manual_seed(n)
    heads, dk, dv = 4, 8, 6
    q, k = ops.prepare_qk(torch.randn(n, 2, dk), torch.randn(n, 2, dk), heads)
    v, beta = torch.randn(n, heads, dv), torch.rand(n, heads)
    g = -torch.rand(n, heads) * 2
    state = torch.randn(heads, dk, dv)
    out, final = ops.chunk_gated_delta_rule(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), g.T, beta.T,
                                            state, chunk=chunk)
    s = state.unsqueeze(0)
    for t in range(n):
        o, s = ops.recurrent_gated_delta_step(q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1], s)
        assert torch.allclose(out[:, t], o[0], atol=1e-5)
    assert torch.allclose(final, s[0], atol=1e-5)


def test_causal_conv_over_chunks_equals_one_call():
    from onecat.engine.layers import gated_deltanet_ops as ops

    torch.manual_seed(0)
    x, w = torch.randn(6, 11), torch.randn(6, 4)
    whole, whole_state = ops.causal_conv(x, torch.zeros(6, 3), w)
    first, state = ops.causal_conv(x[:, :5], torch.zeros(6, 3), w)
    outs = [first]
    for t in range(5, 11):  # then one token at a time
        y, state = ops.causal_conv_step(x[:, t].unsqueeze(0), state.unsqueeze(0), w)
        state = state[0]
        outs.append(y.T)
    assert torch.allclose(torch.cat(outs, dim=1), whole, atol=1e-6)
    assert torch.equal(state, whole_state)


@pytest.fixture(scope="module")
def reference_tokens(hybrid_dir):
    from onecat.engine import LLM

    with LLM(str(hybrid_dir), dtype="float32", max_model_len=96) as base:
        return [o.token_ids for o in base.generate(PROMPTS, greedy())]


@pytest.mark.parametrize("mode", ["none", "align"])
def test_preemption_recomputes_the_state(hybrid_dir, reference_tokens, mode):
    from onecat.engine import LLM

    # 4-token blocks, 25 of them and 8-token steps: the five requests cannot all keep their KV, some are
    # preempted mid-decode and recomputed (align: from the last block whose state was saved)
    with LLM(str(hybrid_dir), dtype="float32", max_model_len=96, max_num_batched_tokens=8, block_size=4,
             num_kv_blocks=26, max_num_seqs=4, mamba_cache_mode=mode) as llm:
        outs = llm.generate(PROMPTS, greedy())
        assert llm.engine.scheduler.num_preemptions > 0
        blocks = llm.engine.blocks
        assert blocks.num_free_blocks == 25 and sorted(blocks.free_state_slots) == [0, 1, 2, 3]
        assert not blocks.pending_restore and not llm.model.states.pins
        assert (llm.model.states.restored > 0) == (mode == "align")  # align: resumed from a saved state
    assert [o.token_ids for o in outs] == reference_tokens


def test_align_prefix_hits_restore_saved_states(hybrid_dir):
    """A 70-token prompt with 16-token blocks is computed as 64 + 6 tokens, so the state after 64 is saved; the
    same prompt again (and one sharing its first 64 tokens) hits those 64 tokens and gives no-hit tokens."""
    from onecat.engine import LLM, SamplingParams

    shared = list(range(20, 84))
    prompts = [shared + [7, 8, 9, 10, 11, 12], shared + [99, 98]]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3)
    with LLM(str(hybrid_dir), dtype="float32", max_model_len=128) as base:
        ref = base.generate(prompts, params)
    with LLM(str(hybrid_dir), dtype="float32", max_model_len=128, mamba_cache_mode="align") as llm:
        first = llm.generate(prompts[:1], params)
        again = llm.generate(prompts, params)
        states = llm.model.states
        assert states.saved == 1 and states.restored == 2  # saved at 64; both prompts restored there
        assert llm.info()["enable_prefix_caching"] is True
    assert first[0].num_cached_tokens == 0 and [o.num_cached_tokens for o in again] == [64, 64]
    for o, r in zip(first + again, ref[:1] + ref):
        assert o.token_ids == r.token_ids
        for mine, theirs in zip(o.logprobs, r.logprobs):
            assert mine.keys() == theirs.keys()
            assert all(abs(mine[t] - theirs[t]) <= 1e-4 for t in mine)


def test_align_chunks_end_at_block_boundaries():
    from onecat.engine.core.block_manager import BlockManager
    from onecat.engine.cache.recurrent_state import RecurrentStateCache

    states = RecurrentStateCache(1, 2, 4, 4, 1, 2, 2, torch.float32, torch.device("cpu"), num_snapshots=2)
    blocks = BlockManager(8, 16, True, states)
    assert [blocks.aligned_chunk(s, n) for s, n in [(0, 70), (64, 6), (0, 8), (8, 8), (10, 1), (15, 1), (3, 40)]] \
        == [64, 6, 8, 8, 1, 1, 29]
    assert BlockManager(8, 16, False, states).aligned_chunk(0, 70) == 70  # prefix caching off: no snapshots


@pytest.mark.parametrize("k,small_kv", [(2, False), (5, False), (3, True)])
def test_speculation_rolls_the_state_back_to_the_accepted_tokens(hybrid_dir, k, small_kv):
    """Greedy n-gram speculation gives the tokens of plain decoding: a verify chunk runs token by token with the
    decode step's ops and keeps each state; the next step starts from the state after the accepted tokens
    (small_kv: some requests are also preempted and recomputed)."""
    from onecat.engine import LLM

    prompts = [[5, 6, 7, 8] * 6, PROMPTS[0], [9, 10, 11] * 5 + [9]]
    with LLM(str(hybrid_dir), dtype="float32", max_model_len=96) as base:
        ref = [o.token_ids for o in base.generate(prompts, greedy(24))]
    memory = dict(max_num_batched_tokens=8, block_size=4, num_kv_blocks=26, max_num_seqs=3) if small_kv else \
        dict(max_num_batched_tokens=16)
    with LLM(str(hybrid_dir), dtype="float32", max_model_len=96, **memory,
             speculative_config={"method": "ngram", "num_speculative_tokens": k}) as llm:
        outs = llm.generate(prompts, greedy(24))
        states = llm.model.states
        assert states.rollbacks > 0 and (llm.engine.scheduler.num_preemptions > 0) == small_kv
    assert [o.token_ids for o in outs] == ref
    assert sum(o.spec.num_accepted_tokens for o in outs) > 0  # some drafts were kept, some rolled back


@pytest.mark.parametrize("spec", [{"method": "ngram", "num_speculative_tokens": 7},
                                  {"method": "draft_model", "num_speculative_tokens": 7}])
def test_speculation_with_align_prefix_caching(hybrid_dir, spec, monkeypatch):
    """Speculation with mamba_cache_mode align: a verify chunk, like a prefill chunk, ends at the last block
    boundary it crosses (8 tokens on 4-token blocks may cross two), and a state is saved at a boundary only when
    the slot stands exactly there: never while it holds drafts past the accepted tokens. Every state saved
    under speculation equals the one plain decoding saves for the same block, and prompts that extend the first
    round's outputs hit those blocks and give plain decoding's tokens."""
    from onecat.engine import LLM
    from onecat.engine.cache.recurrent_state import RecurrentStateCache

    saved_states = []  # per engine: prefix hash -> the DeltaNet state kept for it
    original = RecurrentStateCache.save

    def recording_save(self, slot, key, position=None):
        before = self.saved
        original(self, slot, key, position)
        if self.saved > before:
            saved_states[-1][key] = self.snap_ssm[:, self.snapshots[key]].clone()

    monkeypatch.setattr(RecurrentStateCache, "save", recording_save)
    if spec["method"] == "draft_model":  # the model drafting for itself: every draft accepted
        spec = spec | {"model": str(hybrid_dir)}
    prompts = [[5, 6, 7, 8] * 6, [9, 10, 11] * 5 + [9]] + PROMPTS[:3]
    aligned = dict(dtype="float32", max_model_len=160, block_size=4, mamba_cache_mode="align")
    with LLM(str(hybrid_dir), **aligned) as base:
        saved_states.append({})
        first_ref = [o.token_ids for o in base.generate(prompts, greedy(24))]
        second = [p + t for p, t in zip(prompts, first_ref)]
        second_ref = [o.token_ids for o in base.generate(second, greedy(8))]
    with LLM(str(hybrid_dir), **aligned, speculative_config=spec) as llm:
        saved_states.append({})
        first = llm.generate(prompts, greedy(24))
        assert (llm.model.states.rollbacks > 0) == (spec["method"] == "ngram")  # ngram: drafts were rejected
        again = llm.generate(second, greedy(8))
        assert llm.model.states.restored > 0
    assert [o.token_ids for o in first] == first_ref
    assert [o.token_ids for o in again] == second_ref
    assert any(o.num_cached_tokens > len(p) for o, p in zip(again, prompts))  # hits into generated blocks
    plain, speculated = saved_states
    assert len(speculated) > 20 and set(speculated) <= set(plain)
    for key, state in speculated.items():
        torch.testing.assert_close(state, plain[key], atol=1e-5, rtol=1e-5)


def test_a_hybrid_drafter_drafting_for_itself_is_always_accepted(hybrid_dir, reference_tokens):
    from onecat.engine import LLM

    with LLM(str(hybrid_dir), dtype="float32", max_model_len=96,
             speculative_config={"method": "draft_model", "model": str(hybrid_dir), "num_speculative_tokens": 3}) as llm:
        outs = llm.generate(PROMPTS, greedy())
    assert [o.token_ids for o in outs] == reference_tokens
    assert all(o.spec.num_draft_tokens > 0 and o.spec.num_accepted_tokens == o.spec.num_draft_tokens for o in outs)


def test_each_prompt_alone_equals_batched(hybrid_dir):
    """The batched one-token step (recurrent form) and the per-request chunks see only their own state."""
    from onecat.engine import LLM

    with LLM(str(hybrid_dir), dtype="float32", max_model_len=96, max_num_seqs=2) as llm:
        batched = [o.token_ids for o in llm.generate(PROMPTS, greedy())]
        for p, ref in zip(PROMPTS, batched):
            assert llm.generate([p], greedy())[0].token_ids == ref


def test_prefix_caching_is_off_for_hybrid_models_and_said_once(hybrid_dir, caplog):
    from onecat.engine import LLM

    with caplog.at_level(logging.WARNING, logger="onecat.engine"):
        with LLM(str(hybrid_dir), dtype="float32", max_model_len=96) as llm:
            shared = PROMPTS[2]
            llm.generate([shared, shared], greedy(2))
            llm.generate([shared], greedy(2))
            info = llm.info()
            assert info["enable_prefix_caching"] is False and llm.engine.blocks.prefix_hits == 0
            assert len(llm.worker.kv_caches) == 2  # the two full-attention layers only
    said = [r for r in caplog.records if "prefix caching is off" in r.getMessage()]
    assert len(said) == 1 and "mamba_cache_mode none" in said[0].getMessage()


@pytest.mark.parametrize("settings,needle", [
    ({"mamba_cache_mode": "all"}, "mamba_cache_mode='all'"),
    ({"mamba_cache_mode": "align", "enable_prefix_caching": False}, "enable_prefix_caching true"),
])
def test_unimplemented_hybrid_settings_are_refused(hybrid_dir, settings, needle):
    from onecat.engine import LLM
    from onecat.engine.errors import ConfigError

    with pytest.raises(ConfigError) as exc:
        LLM(str(hybrid_dir), dtype="float32", **settings)
    assert needle in str(exc.value)


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3_5", "qwen3_5_moe"])
def test_tensor_parallel_and_cuda_graphs_are_not_refused(arch):
    """TP shards MoE experts by units and Gated DeltaNet by heads (tests/test_hybrid_tp.py); only more ranks than
    DeltaNet value heads are refused."""
    from onecat.engine.args import EngineArgs
    from onecat.engine.config import ModelConfig
    from onecat.engine.models.support import unsupported_settings

    cfg = ModelConfig.from_hf({"architectures": [{"qwen3_moe": "Qwen3MoeForCausalLM", "qwen3_5": "Qwen3_5ForCausalLM",
                                                  "qwen3_5_moe": "Qwen3_5MoeForCausalLM"}[arch]],
                               "vocab_size": 8, "hidden_size": 8, "num_hidden_layers": 4, "num_attention_heads": 2,
                               "linear_num_key_heads": 2, "linear_num_value_heads": 4})
    args = EngineArgs(model="x", tensor_parallel_size=2, cuda_graph="full")
    problems = unsupported_settings(args, cfg, torch.device("cuda"))
    assert not any("tensor_parallel_size" in p for p in problems)
    assert not any("cuda_graph" in p for p in problems)  # decode steps of all three capture (cuda_graph.py)
    assert unsupported_settings(EngineArgs(model="x", cuda_graph="full"), cfg, torch.device("cpu")) == []
    too_many = unsupported_settings(EngineArgs(model="x", tensor_parallel_size=5), cfg, torch.device("cpu"))
    refused = any("tensor_parallel_size=5 exceeds the 4 Gated DeltaNet value heads" in p for p in too_many)
    assert refused == (arch != "qwen3_moe")


def test_align_is_refused_for_models_without_recurrent_state():
    from onecat.engine.args import EngineArgs
    from onecat.engine.config import ModelConfig
    from onecat.engine.models.support import unsupported_settings

    cfg = ModelConfig.from_hf({"architectures": ["Qwen3ForCausalLM"], "vocab_size": 8, "hidden_size": 8,
                               "intermediate_size": 8, "num_hidden_layers": 2, "num_attention_heads": 2})
    [problem] = unsupported_settings(EngineArgs(model="x", mamba_cache_mode="align"), cfg, torch.device("cpu"))
    assert "qwen3 has none" in problem and "use mamba_cache_mode none" in problem


def test_bfloat16_runs_with_a_float32_recurrent_state(hybrid_dir):
    """bfloat16 weights and activations; the DeltaNet state stays float32, the convolution inputs bfloat16."""
    from onecat.engine import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=3)
    with LLM(str(hybrid_dir), dtype="float32", max_model_len=96) as fp32:
        ref = fp32.generate(PROMPTS[:3], params)
    with LLM(str(hybrid_dir), dtype="bfloat16", max_model_len=96, max_num_batched_tokens=24) as bf16:
        states = bf16.model.states
        assert states.ssm.dtype == torch.float32 and states.conv.dtype == torch.bfloat16
        outs = bf16.generate(PROMPTS[:3], params)
    for o, r in zip(outs, ref):
        shared = set(o.logprobs[0]) & set(r.logprobs[0])
        assert shared and all(abs(o.logprobs[0][t] - r.logprobs[0][t]) < 0.05 for t in shared)


# ---- the decode steps CUDA graphs replay, on CPU ------------------------------------------------------------------
@pytest.fixture
def graph_like_decode(monkeypatch):
    """Every pure decode step runs as a CUDA graph's replay runs it (engine/worker/cuda_graph.py): the host side
    through `prepare_decode`, the model given its rows' state slots as a tensor (decode_plan). Yields the steps'
    sizes."""
    from onecat.engine.attention.forward_context import get_forward_context
    from onecat.engine.models.qwen3_5 import Qwen3_5ForCausalLM

    original, steps = Qwen3_5ForCausalLM.forward, []

    def forward(self, input_ids, positions):
        ctx = get_forward_context()
        if all(q == 1 for q in ctx.meta.query_lens_cpu) and not any(ctx.lookaheads or []):
            self.states.prepare_decode(ctx.state_slots, ctx.meta.seq_lens_cpu)
            ctx.state_slots = torch.tensor(ctx.state_slots, dtype=torch.int64)
            steps.append(len(ctx.state_slots))
        return original(self, input_ids, positions)

    monkeypatch.setattr(Qwen3_5ForCausalLM, "forward", forward)
    return steps


def test_graph_decode_plan_gives_the_eager_tokens(hybrid_dir, reference_tokens, graph_like_decode, monkeypatch):
    """Plain decoding, and one-token prompts (their first step is a decode step from a zeroed slot), batched."""
    from onecat.engine import LLM

    with LLM(str(hybrid_dir), dtype="float32", max_model_len=96) as llm:
        outs = llm.generate(PROMPTS, greedy())
        one = llm.generate([[42], [7]], greedy())
    assert [o.token_ids for o in outs] == reference_tokens and 5 in graph_like_decode and 2 in graph_like_decode
    monkeypatch.undo()
    with LLM(str(hybrid_dir), dtype="float32", max_model_len=96) as llm:
        assert [o.token_ids for o in one] == [o.token_ids for o in llm.generate([[42], [7]], greedy())]


def test_graph_decode_plan_keeps_align_preemption_and_rollback(hybrid_dir, reference_tokens, graph_like_decode):
    """Decode steps through prepare_decode / decode_plan with mamba_cache_mode align and preemption (states
    restored from snapshots), and with n-gram speculation (a decode step after rejected drafts rolls the slot
    back first): plain decoding's tokens."""
    from onecat.engine import LLM

    with LLM(str(hybrid_dir), dtype="float32", max_model_len=96, max_num_batched_tokens=8, block_size=4,
             num_kv_blocks=26, max_num_seqs=4, mamba_cache_mode="align") as llm:
        outs = llm.generate(PROMPTS, greedy())
        assert llm.engine.scheduler.num_preemptions > 0 and llm.model.states.restored > 0
    assert [o.token_ids for o in outs] == reference_tokens
    prompts = [[5, 6, 7, 8] * 6, PROMPTS[0], [9, 10, 11] * 5 + [9]]
    with LLM(str(hybrid_dir), dtype="float32", max_model_len=96) as base:
        ref = [o.token_ids for o in base.generate(prompts, greedy(24))]
    graph_like_decode.clear()
    with LLM(str(hybrid_dir), dtype="float32", max_model_len=96, max_num_batched_tokens=16,
             speculative_config={"method": "ngram", "num_speculative_tokens": 3}) as llm:
        outs = [llm.generate([p], greedy(24))[0] for p in prompts]
        assert llm.model.states.rollbacks > 0
    assert [o.token_ids for o in outs] == ref and graph_like_decode


def test_snapshot_not_saved_once_the_slot_moved_past_it():
    """The one-step-ahead decode launches a request's next step before the block manager sees the last: a save
    keyed at that position then finds the slot one token further and keeps nothing."""
    from onecat.engine.cache.recurrent_state import RecurrentStateCache

    states = RecurrentStateCache(1, 2, 4, 4, 1, 2, 2, torch.float32, torch.device("cpu"), num_snapshots=2)
    assert states.conv.shape[1] == 3 and states.scratch_slot == 2  # two slots and the graphs' scratch slot
    states.position[0] = 15
    states.prepare_decode([0], [16])  # slot 0 holds the state after 16 tokens
    states.ssm[:, 0] = 1.0
    states.save(0, key=111, position=16)
    states.prepare_decode([0], [17])
    states.save(0, key=222, position=16)
    assert states.has(111) and not states.has(222) and states.saved == 1
    states.prepare_decode([1], [1])  # a request at position 0 starts from a zeroed slot
    assert states.position[:2] == [17, 1] and float(states.ssm[:, 1].abs().sum()) == 0.0
