"""The engine core owns its requests: a refused request leaves nothing behind, a refused prompt fails alone,
callers read and hand back requests through the core's methods, and the one-step-ahead pipeline applies
its steps with the plain step's post-processing (same tokens)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from onecat.engine import InvalidRequestError, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def _all_blocks_free(core) -> bool:
    return core.blocks.num_free_blocks == core.blocks.num_blocks - 1  # block 0 is the null block


def _sampling(**changes) -> SamplingParams:
    """Valid settings, then changed in place: the core checks again what it is handed."""
    params = SamplingParams(max_tokens=4)
    for name, value in changes.items():
        setattr(params, name, value)
    return params


REFUSALS = {
    "bad sampling value": (lambda llm: [5, 6, 7], lambda llm: _sampling(temperature=-1.0), "temperature"),
    "over-long prompt": (lambda llm: [5] * llm.max_model_len, lambda llm: _sampling(), "max_model_len"),
    "ids outside the vocabulary": (lambda llm: [5, llm.model_config.vocab_size], lambda llm: _sampling(),
                                   "outside the vocabulary"),
    "logprobs > vocab": (lambda llm: [5, 6], lambda llm: _sampling(logprobs=llm.model_config.vocab_size + 1),
                         "logprobs="),
    "stop id outside the vocabulary": (lambda llm: [5, 6], lambda llm: _sampling(stop_token_ids=[-1]),
                                       "stop_token_ids"),
    "empty prompt": (lambda llm: [], lambda llm: _sampling(), "empty"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_refused_request_creates_nothing(embedded_llm, case):
    ids_of, params_of, needle = REFUSALS[case]
    core = embedded_llm.engine
    with pytest.raises(InvalidRequestError, match=needle):
        core.add_request("refused", None, ids_of(embedded_llm), params_of(embedded_llm))
    assert "refused" not in core
    assert not core.has_unfinished()
    assert _all_blocks_free(core)
    with pytest.raises(KeyError, match="refused"):
        core.output("refused")


def test_request_id_in_use_is_refused(embedded_llm):
    core = embedded_llm.engine
    core.add_request("twice", None, [5, 6, 7], GREEDY)
    try:
        with pytest.raises(InvalidRequestError, match="already in use"):
            core.add_request("twice", None, [8, 9], GREEDY)
        assert core.output("twice").prompt_token_ids == [5, 6, 7]  # the first one is untouched
    finally:
        core.release("twice")
    assert "twice" not in core and _all_blocks_free(core)


def test_refused_prompt_in_a_batch_fails_alone(embedded_llm):
    vocab = embedded_llm.model_config.vocab_size
    prompts = ["The capital of France is", [7, vocab + 3], "def add(a, b):"]
    params = [GREEDY, GREEDY, SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=8, ignore_eos=True)]
    outs = embedded_llm.generate(prompts, params)
    refused = outs[1]
    assert refused.finish_reason == "abort" and "outside the vocabulary" in refused.error
    assert refused.token_ids == [] and refused.prompt_token_ids == [7, vocab + 3] and refused.finished
    for i in (0, 2):
        alone = embedded_llm.generate([prompts[i]], params[i])[0]
        assert outs[i].error is None and len(outs[i].token_ids) == 8
        assert outs[i].token_ids == alone.token_ids
    assert not embedded_llm.engine.has_unfinished() and _all_blocks_free(embedded_llm.engine)


def test_pop_output_and_release_hand_requests_back(embedded_llm):
    core = embedded_llm.engine
    core.add_request("done", None, [5, 6, 7], GREEDY)
    core.add_request("dropped", None, [8, 9, 10], SamplingParams(temperature=0.0, max_tokens=500, ignore_eos=True))
    while not core.output("done").finished:
        core.step()
    out = core.pop_output("done")
    assert out.finished and out.finish_reason == "length" and len(out.token_ids) == 8
    assert "done" not in core
    assert not core.output("dropped").finished
    core.release("dropped")  # still running: aborted, its KV blocks freed
    assert "dropped" not in core and not core.has_unfinished() and _all_blocks_free(core)


def test_sampling_params_with_processors_copy_and_compare():
    def mask(tokens, row):
        return row

    params = SamplingParams(temperature=0.0, logits_processors=(mask,), keep_probs=True)
    assert params.logits_processors == [mask]
    copy = dataclasses.replace(params, seed=3)
    assert copy.logits_processors == [mask] and copy.keep_probs and copy.seed == 3
    assert copy == dataclasses.replace(params, seed=3) and copy != params
    with pytest.raises(InvalidRequestError, match="logits_processors"):
        SamplingParams(logits_processors=["not callable"])
    with pytest.raises(InvalidRequestError, match="keep_probs"):
        SamplingParams(keep_probs="yes")


def _pipeline_against_plain_steps(tmp_path, prompts, params, **settings) -> None:
    """The same requests with the one-step-ahead pipeline off and on: the same tokens, stops and counts, the
    pipeline used only when on, and every KV block free after either."""
    from onecat.engine import LLM
    from tests.tiny_models import make_tiny_model

    model_dir = make_tiny_model("llama", tmp_path / "tiny", hidden_size=256, num_attention_heads=8,
                                num_key_value_heads=2)
    seen = {}
    for on in (False, True):
        with LLM(str(model_dir), device="cuda", dtype="float16", max_model_len=512, kv_cache_memory_gb=1.0,
                 cuda_graph=True, async_scheduling=on, **settings) as llm:
            outs = llm.generate(prompts, params)
            core = llm.engine
            seen[on] = ([(o.token_ids, o.finish_reason) for o in outs], core.stats["generation_tokens"],
                        llm.info()["async_scheduling"]["launches"])
            assert not core.has_unfinished() and _all_blocks_free(core)
    assert seen[True][:2] == seen[False][:2]
    assert seen[False][2] == 0 and seen[True][2] > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_pipeline_and_plain_step_apply_steps_alike(tmp_path):
    """The one-step-ahead pipeline and the plain step give the same tokens, stops and counts, and both
    leave every KV block free."""
    prompts = [" ".join(f"t{(i * 7 + j * 3) % 300 + 1}" for j in range(n)) for i, n in enumerate((5, 37, 130))]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (5, 30, 17)]
    _pipeline_against_plain_steps(tmp_path, prompts, params)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("wave", [1, 2])
def test_pipeline_runs_while_requests_wait_and_keeps_tokens(tmp_path, wave):
    """With more requests than slots, the pipeline runs while nothing can be admitted (slots full, or an
    admission wave not open) and drains for each admission: the plain step's tokens, stops and counts."""
    prompts = [" ".join(f"t{(i * 5 + j * 3) % 300 + 1}" for j in range(4 + 9 * i)) for i in range(7)]
    params = [SamplingParams(temperature=0.0, max_tokens=4 + (11 * i) % 23, ignore_eos=True) for i in range(7)]
    _pipeline_against_plain_steps(tmp_path, prompts, params, max_num_seqs=3, admission_wave=wave)
