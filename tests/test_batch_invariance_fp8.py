"""A request's tokens and logprobs on CPU do not depend on its batch or on prefix-cache hits.

With an fp8 KV cache any one-ulp change in a K or V row can flip an 8-bit rounding step, so the
linear layers and attention must give every token bitwise the same result whatever the step holds
(row count, query length, the other sequences and their lengths, chunked prefill).
"""
from __future__ import annotations

import random

import pytest
import torch

from onecat.engine import LLM, SamplingParams
from onecat.engine.layers.linear import Linear
from tests.conftest import EMBEDDED

CHATS = ["What is 12 plus 30? Reply with the number only.",
         "Which planet is known as the Red Planet? Answer in a few words.",
         "How many days are in a week? Reply with the number only."]


def _tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


# 49 tokens: a rerun reuses three cached blocks and prefills one token; 600: keys past 512, and
# chunked prefill (256-token budget) alongside the other sequences' decode steps.
RAW = [_tokens(49, 1), _tokens(600, 2), _tokens(130, 3)]


def _run(llm: LLM, prompts: list[list[int]]) -> list[tuple]:
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    return [(o.token_ids, o.logprobs, o.num_cached_tokens) for o in llm.generate(prompts, params)]


def _chat_ids(llm: LLM, text: str) -> list[int]:
    prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    return llm.tokenizer.encode(prompt, add_special_tokens=False)


@pytest.mark.parametrize("kv", [pytest.param("fp8_e5m2", marks=pytest.mark.slow), "auto"])
def test_tokens_do_not_depend_on_batch_or_prefix_cache(kv):
    with LLM(EMBEDDED, dtype="float32", kv_cache_dtype=kv, max_model_len=2048, max_num_seqs=8,
             max_num_batched_tokens=256, kv_cache_memory_gb=0.25) as llm:
        prompts = [_chat_ids(llm, c) for c in CHATS] + RAW
        fresh = _run(llm, prompts)  # one batch
        cached = _run(llm, prompts)  # the same batch, prefixes from the cache
        solo = [_run(llm, [p])[0] for p in prompts]
    assert all(n == 0 for *_, n in fresh)
    assert all(n > 0 for *_, n in cached) and all(n > 0 for *_, n in solo)
    assert cached[len(CHATS)][2] == 48  # a one-token prefill after the cache hit
    for i, (want, again, alone) in enumerate(zip(fresh, cached, solo)):
        assert again[:2] == want[:2], f"request {i}: prefix-cached run differs from the fresh batch"
        assert alone[:2] == want[:2], f"request {i}: alone differs from the batch"


@pytest.mark.parametrize("k,n,bias", [(576, 960, True), (1536, 576, False)])
def test_linear_rows_do_not_depend_on_row_count(k, n, bias):
    torch.manual_seed(0)
    layer = Linear(k, n, bias=bias)
    x = torch.randn(300, k)
    with torch.inference_mode():
        full = layer(x)
        for rows in (1, 2, 3, 7, 16, 33, 130):
            for start in (0, 5, 150):
                assert torch.equal(layer(x[start:start + rows]), full[start:start + rows]), (rows, start)
