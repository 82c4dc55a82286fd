"""Engine runtime behaviour on the embedded model: batching, caching, preemption, KV dtypes, sampling, stops."""
from __future__ import annotations

import math

import pytest

from onecat.engine import LLM, SamplingParams
from tests.conftest import EMBEDDED

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
PROMPTS = ["The history of the Roman Empire began", "def quicksort(arr):\n", "My favourite food is",
           "Photosynthesis is the process by which", "1, 2, 3, 4,"]


@pytest.fixture(scope="module")
def reference_tokens(embedded_llm):
    return [o.token_ids for o in embedded_llm.generate(PROMPTS, GREEDY)]


def test_each_prompt_alone_equals_batched(embedded_llm, reference_tokens):
    for p, ref in zip(PROMPTS, reference_tokens):
        assert embedded_llm.generate([p], GREEDY)[0].token_ids == ref


def test_chunked_prefill_and_preemption_keep_tokens(reference_tokens):
    # 8-token budget chunks every prompt; 12 KV blocks of 4 tokens cannot hold all five sequences,
    # so some are preempted and recomputed. The reference: an engine with room for all of them at once.
    with LLM(EMBEDDED, max_model_len=48, max_num_batched_tokens=8, block_size=4, num_kv_blocks=13) as llm:
        outs = llm.generate(PROMPTS, GREEDY)
        assert llm.engine.scheduler.num_preemptions > 0
        assert llm.engine.blocks.num_free_blocks == 12  # everything returned to the free list
    assert [o.token_ids for o in outs] == reference_tokens


def test_prefix_cache_hits_do_not_change_output(embedded_llm):
    shared = "You are a careful assistant. Answer in one sentence. " * 4
    prompts = [shared + q for q in ("What is rain?", "What is snow?")]
    first = embedded_llm.generate(prompts, GREEDY)
    hits_before = embedded_llm.engine.blocks.prefix_hits
    again = embedded_llm.generate(prompts, GREEDY)
    assert embedded_llm.engine.blocks.prefix_hits > hits_before
    assert all(o.num_cached_tokens > 0 for o in again)
    assert [o.token_ids for o in first] == [o.token_ids for o in again]
    with LLM(EMBEDDED, max_model_len=512, enable_prefix_caching=False) as no_cache:
        assert [o.token_ids for o in no_cache.generate(prompts, GREEDY)] == [o.token_ids for o in first]


@pytest.mark.parametrize("kv", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_kv_cache_stays_close(embedded_llm, kv):
    text = ["The quick brown fox jumps over the lazy dog. " * 6]
    ref = embedded_llm.score(text)[0]
    with LLM(EMBEDDED, max_model_len=512, kv_cache_dtype=kv) as llm:
        assert llm.worker.kv_caches[0].k.dtype.itemsize == 1
        got = llm.score(text)[0]
    assert got.prompt_token_ids == ref.prompt_token_ids
    nll_ref, nll = -ref.sum_logprob / ref.num_scored, -got.sum_logprob / got.num_scored
    assert nll != nll_ref  # 8-bit storage really is in use
    assert abs(nll - nll_ref) / nll_ref < 0.05


def test_seeded_request_is_batch_invariant(embedded_llm):
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, min_p=0.02, seed=1234, max_tokens=32,
                            ignore_eos=True)
    alone = embedded_llm.generate(["Tell me a story about a dragon"], params)[0].token_ids
    others = [SamplingParams(temperature=1.0, seed=s, max_tokens=20 + s) for s in range(7)]
    batch = embedded_llm.generate(["Tell me a story about a dragon"] + PROMPTS + PROMPTS[:2], [params] + others)
    assert batch[0].token_ids == alone
    again = embedded_llm.generate(["Tell me a story about a dragon"], params)[0].token_ids
    assert again == alone
    other_seed = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, min_p=0.02, seed=99, max_tokens=32,
                                ignore_eos=True)
    assert embedded_llm.generate(["Tell me a story about a dragon"], other_seed)[0].token_ids != alone


def test_top_k_one_is_greedy(embedded_llm, reference_tokens):
    params = SamplingParams(temperature=1.5, top_k=1, seed=7, max_tokens=24, ignore_eos=True)
    assert embedded_llm.generate(PROMPTS[:2], params)[0].token_ids == reference_tokens[0]


def test_stop_conditions(embedded_llm):
    out = embedded_llm.generate(["Count: 1, 2, 3,"], SamplingParams(temperature=0, max_tokens=40, stop=["7"]))[0]
    assert out.finish_reason == "stop" and out.stop_reason == "7"
    assert "7" not in out.text and out.text.strip().startswith("4")
    ref = embedded_llm.generate(["Count: 1, 2, 3,"], SamplingParams(temperature=0, max_tokens=5))[0]
    assert ref.finish_reason == "length" and ref.num_completion_tokens == 5
    stop_tok = ref.token_ids[2]
    out = embedded_llm.generate(["Count: 1, 2, 3,"],
                                SamplingParams(temperature=0, max_tokens=5, stop_token_ids=[stop_tok]))[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop_tok and out.token_ids == ref.token_ids[:3]
    chat = embedded_llm.chat([{"role": "user", "content": "Say hello."}], SamplingParams(temperature=0, max_tokens=64))[0]
    assert chat.finish_reason == "stop" and chat.token_ids[-1] in embedded_llm.tokenizer.eos_token_ids


def test_timings_and_counts(embedded_llm):
    out = embedded_llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    t = out.timings
    assert out.num_prompt_tokens == len(embedded_llm.tokenizer.encode("Hello"))
    assert out.num_completion_tokens == 8
    assert 0 <= t.queue_s <= t.first_token_s <= t.e2e_s and t.decode_s > 0
    assert out.tpot_s is not None and out.tpot_s > 0


def test_score_matches_generation_logprobs(embedded_llm):
    prompt = embedded_llm.tokenizer.encode("Paris is the capital of")
    out = embedded_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, logprobs=0))[0]
    full = embedded_llm.score([prompt + out.token_ids])[0]
    assert math.isclose(full.logprobs[-1], out.logprobs[0][out.token_ids[0]], abs_tol=1e-4)
    assert full.num_scored == len(prompt)
