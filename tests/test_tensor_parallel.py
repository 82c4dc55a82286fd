"""Tensor parallel on CPU (gloo, one process per rank) on the embedded model (9 query / 3 KV heads):
greedy tokens equal to TP=1 with the heads split unevenly (TP=2) and the KV heads replicated (TP=4),
with chunked prefill, preemption, prefix-cache hits and speculative decoding; a dead rank (of a tiny checkpoint's
engine) fails the engine with its reason and leaves no process; what TP does not build is refused clearly."""
from __future__ import annotations

import os
import signal
import time

import pytest

from onecat.engine import LLM, SamplingParams
from onecat.engine.errors import ConfigError
from tests.conftest import EMBEDDED
from tests.test_speculative import PROMPTS

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
SMALL = dict(max_model_len=96, max_num_batched_tokens=16, block_size=4, num_kv_blocks=40)


class _Reference(dict):
    """TP=1 tokens by setting, each made the first time a test reads it (the default run reads only "small")."""

    SETTINGS = {"plain": dict(max_model_len=256), "small": SMALL}

    def __missing__(self, key: str) -> list:
        with LLM(EMBEDDED, **self.SETTINGS[key]) as llm:
            self[key] = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
        return self[key]


@pytest.fixture(scope="module")
def reference():
    """TP=1 tokens: plain, and with a small KV cache and prefill chunks (preemption, chunked prefill)."""
    return _Reference()


@pytest.mark.slow  # the default run checks uneven head splits in-process (tests/test_tp_sharding.py)
def test_tp2_uneven_heads_matches_tp1(reference):
    with LLM(EMBEDDED, max_model_len=256, tensor_parallel_size=2) as llm:
        tp = llm.info()["tensor_parallel"]
        assert tp["size"] == 2 and tp["backend"] == "gloo" and all(tp["workers_alive"])
        assert tp["query_heads"] == [6, 3] and tp["kv_heads"] == [[0, 1], [2]]
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == reference["plain"]
        # again: every prompt now hits the prefix cache
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == reference["plain"]


def test_tp2_with_chunked_prefill_and_preemption(reference):
    with LLM(EMBEDDED, tensor_parallel_size=2, **SMALL) as llm:
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == reference["small"]
        assert llm.engine.scheduler.num_preemptions > 0


@pytest.mark.slow  # a second TP engine; speculation's rollback under TP is also in test_hybrid_tp (slow) and the GPU TP tests
def test_tp2_with_ngram_speculation(reference):
    check_speculation_under_tp({"method": "ngram", "num_speculative_tokens": 4}, reference)


@pytest.mark.slow
def test_tp2_with_a_dflash_drafter_on_rank_0(reference):
    """DFlash under TP: rank 0 keeps a whole vocabulary for the drafter (slow: a third TP engine)."""
    check_speculation_under_tp({"method": "dflash", "model": "embedded:smollm2-135m-dflash",
                                "num_speculative_tokens": 3}, reference)


def check_speculation_under_tp(spec: dict, reference) -> None:
    with LLM(EMBEDDED, max_model_len=256, tensor_parallel_size=2, speculative_config=spec) as llm:
        outs = llm.generate(PROMPTS, GREEDY)
        assert [o.token_ids for o in outs] == reference["plain"]
        assert sum(o.spec.num_accepted_tokens for o in outs) > 0, spec["method"]


@pytest.mark.slow
def test_tp4_replicated_kv_heads_matches_tp1(reference):
    with LLM(EMBEDDED, max_model_len=256, tensor_parallel_size=4) as llm:
        tp = llm.info()["tensor_parallel"]
        assert tp["query_heads"] == [2, 1, 3, 3] and tp["kv_heads"] == [[0], [0], [1], [2]]
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == reference["plain"]


def test_a_dead_rank_fails_the_engine_cleanly(tmp_path):
    from tests.tiny_models import make_tiny_model

    # a tiny checkpoint: what is checked is the engine's reaction to the lost rank, not the model's numerics
    llm = LLM(str(make_tiny_model("llama", tmp_path / "llama")), max_model_len=96, tensor_parallel_size=2)
    worker = llm.tp.workers.procs[0]
    assert llm.down_reason() is None
    os.kill(worker.pid, signal.SIGKILL)
    worker.join(timeout=10)
    assert "tensor-parallel rank 1 is not running" in llm.down_reason()  # what the server's /health answers
    t0 = time.monotonic()
    with pytest.raises(Exception, match="rank 1") as err:
        llm.generate(["t1 t5 t9"], GREEDY)
    assert "tensor parallel engine stopped" in str(err.value)
    assert time.monotonic() - t0 < 30
    assert not any(llm.tp.workers.alive())
    llm.close()


def test_what_tensor_parallel_does_not_build_is_refused():
    with pytest.raises(ConfigError, match="pipeline_parallel_size=2.*use tensor_parallel_size"):
        LLM(EMBEDDED, pipeline_parallel_size=2)
    with pytest.raises(ConfigError, match="packed weights are not sharded"):
        LLM(EMBEDDED, tensor_parallel_size=2, quantization="gguf")



def test_shared_memory_collectives_sum_in_rank_order_on_every_rank():
    """CPU ranks' all-reduce through shared memory: every rank gets the same bits, the sum in rank order,
    over repeated calls (both parity buffers); all-gather returns each rank's tensor."""
    import multiprocessing as mp

    import torch

    from tests.shared_memory_ranks import shm_rank

    ctx = mp.get_context("spawn")
    world, ready, out = 3, ctx.Event(), ctx.Queue()
    name = f"onecat_tp_test_{os.getpid()}"
    procs = [ctx.Process(target=shm_rank, args=(r, world, name, ready, out)) for r in range(world)]
    for p in procs:
        p.start()
    got = dict(out.get(timeout=60) for _ in range(world))
    for p in procs:
        p.join(timeout=30)
    xs = [torch.randn(5, 7, generator=torch.Generator().manual_seed(r)) for r in range(world)]
    for step in range(3):
        want = xs[0] * (step + 1) + xs[1] * (step + 1) + xs[2] * (step + 1)
        for r in range(world):
            y, pieces = got[r][step]
            assert torch.equal(y, want)
            assert all(torch.equal(p, torch.full((2, 3), float(q + step))) for q, p in enumerate(pieces))


@pytest.mark.parametrize("arch, world, extra", [
    ("qwen2", 2, {}),  # q/k/v biases sliced with their heads
    ("qwen3", 3, dict(num_attention_heads=2, num_key_value_heads=1)),  # q/k norms; rank 2 has no query head
])
def test_shards_load_straight_from_an_untied_checkpoint(tmp_path, arch, world, extra):
    """Each rank slices the checkpoint's tensors to its share while loading (the model is sharded on the meta
    device first): untied LM head, biases, q/k norms and a rank without query heads all score as TP=1 (the
    tied embedded Llama is the other TP tests' model)."""
    from tests.tiny_models import make_tiny_model

    model_dir = make_tiny_model(arch, tmp_path / arch, tie_word_embeddings=False, **extra)
    assert_tp_scores_as_tp1(model_dir, world, ["t1 t5 t9 t33 t70 t2", "t4 t4 t8 t100"])


def assert_tp_scores_as_tp1(model_dir, world: int, prompts: list[str], check_sharded=None) -> None:
    """Prompt logprobs at TP=world equal TP=1's to float32 summation order, greedy tokens equal;
    check_sharded(llm) inspects the TP engine."""
    import torch

    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=0)
    scores = {}
    for tp in (1, world):
        with LLM(str(model_dir), max_model_len=96, tensor_parallel_size=tp) as llm:
            outs = llm.generate(prompts, params)
            scores[tp] = (torch.tensor([lp for o in outs for lp in o.prompt_logprobs[1:]]),
                          [o.token_ids for o in outs])
            if tp > 1 and check_sharded is not None:
                check_sharded(llm)
    assert torch.allclose(scores[1][0], scores[world][0], rtol=0, atol=1e-4)
    assert scores[1][1] == scores[world][1]


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_moe_experts_shard_by_units_and_score_as_tp1(tmp_path, world):
    """Qwen3-MoE under TP: every expert keeps a share of its intermediate units (48 over 3 ranks: 16 each; over
    2: 24), the router stays whole, the dense MLP layer (mlp_only_layers) shards as usual; each rank loads its
    share of the checkpoint's expert tensors. Prompt logprobs equal TP=1's to float32 summation order, tokens
    equal."""
    from tests.tiny_moe_hybrid import make_tiny_moe_hybrid

    model_dir = make_tiny_moe_hybrid("qwen3_moe", tmp_path / "moe")

    def check(llm):
        experts = llm.model.layers[0].mlp.experts
        assert experts.intermediate == 48 // world and experts.gate_up_proj.shape == (8, 2 * 48 // world, 64)

    assert_tp_scores_as_tp1(model_dir, world, ["t1 t5 t9 t33 t70 t2", "t4 t4 t8 t100 t200 t3 t7"], check)


def test_expert_tensors_are_cut_alike_in_every_checkpoint_layout():
    """Per-expert, stacked (GGUF) and fused expert tensors give a rank the same share of each expert."""
    import torch
    from torch import nn

    from onecat.engine.layers.moe import Experts
    from onecat.engine.parallel.shard_loading import ShardLoader
    from onecat.engine.parallel.sharding import _shard_experts

    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([nn.Module()])
            self.layers[0].mlp = nn.Module()
            self.layers[0].mlp.experts = Experts(3, 4, 6)

        def _shard_offset(self, fused, shard):
            return 0, 0

    model = Tiny()
    _shard_experts(model.layers[0].mlp.experts, rank=1, world=2, group=None)  # units 3..5
    loader = ShardLoader(model)
    gate, up, down = torch.randn(3, 6, 4), torch.randn(3, 6, 4), torch.randn(3, 4, 6)
    p = "model.layers.0.mlp.experts"
    per_expert = dict(loader.weights(
        [(f"{p}.{e}.{n}.weight", t[e]) for e in range(3) for n, t in (("gate_proj", gate), ("up_proj", up),
                                                                       ("down_proj", down))]))
    stacked = dict(loader.weights([(f"{p}.gate_proj.weight", gate), (f"{p}.up_proj.weight", up),
                                   (f"{p}.down_proj.weight", down)]))
    fused = dict(loader.weights([(f"{p}.gate_up_proj", torch.cat([gate, up], 1)), (f"{p}.down_proj", down)]))
    for e in range(3):
        assert torch.equal(per_expert[f"{p}.{e}.gate_proj.weight"], gate[e, 3:])
        assert torch.equal(per_expert[f"{p}.{e}.down_proj.weight"], down[e, :, 3:])
    assert torch.equal(stacked[f"{p}.up_proj.weight"], up[:, 3:])
    assert torch.equal(stacked[f"{p}.down_proj.weight"], down[:, :, 3:])
    assert torch.equal(fused[f"{p}.gate_up_proj"], torch.cat([gate[:, 3:], up[:, 3:]], 1))
    assert torch.equal(fused[f"{p}.down_proj"], down[:, :, 3:])
