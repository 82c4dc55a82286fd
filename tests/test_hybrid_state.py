"""The recurrent state of hybrid models (Qwen3.5) in the engine: the chunked and recurrent forms of the gated
delta rule agree, state slots follow requests through preemption (recomputed from position 0), and the
settings the engine cannot honour for hybrid models are refused or said."""
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


def test_preemption_recomputes_the_state(hybrid_dir):
    from onecat.engine import LLM

    with LLM(str(hybrid_dir), dtype="float32", max_model_len=96) as base:
        ref = [o.token_ids for o in base.generate(PROMPTS, greedy())]
    # 4-token blocks, 30 of them and 8-token steps: the five requests cannot all keep their KV, some are
    # preempted mid-decode and recomputed from position 0
    with LLM(str(hybrid_dir), dtype="float32", max_model_len=96, max_num_batched_tokens=8, block_size=4,
             num_kv_blocks=31, max_num_seqs=4) as llm:
        outs = llm.generate(PROMPTS, greedy())
        assert llm.engine.scheduler.num_preemptions > 0
        blocks = llm.engine.blocks
        assert blocks.num_free_blocks == 30 and sorted(blocks.free_state_slots) == [0, 1, 2, 3]
    assert [o.token_ids for o in outs] == ref


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
            assert len(llm.engine.runner.kv_caches) == 2  # the two full-attention layers only
    said = [r for r in caplog.records if "prefix caching is off" in r.getMessage()]
    assert len(said) == 1 and "mamba_cache_mode none" in said[0].getMessage()


@pytest.mark.parametrize("settings,needle", [
    ({"mamba_cache_mode": "align"}, "mamba_cache_mode='align'"),
    ({"mamba_cache_mode": "all"}, "mamba_cache_mode='all'"),
    ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}}, "speculative decoding on hybrid"),
])
def test_unimplemented_hybrid_settings_are_refused(hybrid_dir, settings, needle):
    from onecat.engine import LLM
    from onecat.engine.errors import ConfigError

    with pytest.raises(ConfigError, match="not implemented") as exc:
        LLM(str(hybrid_dir), dtype="float32", **settings)
    assert needle in str(exc.value)


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3_5", "qwen3_5_moe"])
def test_tensor_parallel_and_cuda_graphs_are_refused_for_moe_and_hybrid(arch):
    from onecat.engine.args import EngineArgs
    from onecat.engine.config import ModelConfig
    from onecat.engine.models.support import unsupported_settings

    cfg = ModelConfig.from_hf({"architectures": [{"qwen3_moe": "Qwen3MoeForCausalLM", "qwen3_5": "Qwen3_5ForCausalLM",
                                                  "qwen3_5_moe": "Qwen3_5MoeForCausalLM"}[arch]],
                               "vocab_size": 8, "hidden_size": 8, "num_hidden_layers": 4, "num_attention_heads": 2})
    args = EngineArgs(model="x", tensor_parallel_size=2, cuda_graph="full")
    problems = unsupported_settings(args, cfg, torch.device("cuda"))
    assert any("tensor_parallel_size=2 is not implemented" in p for p in problems)
    assert any("cuda_graph='full' is not implemented" in p for p in problems)
    assert unsupported_settings(EngineArgs(model="x", cuda_graph="full"), cfg, torch.device("cpu")) == []
