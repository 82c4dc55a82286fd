"""The endpoint load runner and the OpenAI-endpoint engine backends."""
from __future__ import annotations

import numpy as np
import pytest
from pydantic import ValidationError

from onecat.gates.contract import ArmSettings, EngineSpec, ModelSpec, SamplingSpec
from onecat.gates.engines.openai_client import metrics_delta, parse_prometheus, spec_acceptance
from onecat.gates.runners.endpoint import (EndpointRunner, EndpointWorkload, arrival_gaps, make_prompts,
                                           prompt_lengths)
from tests.conftest import EMBEDDED


class ListSink:
    arm, workload_id = "baseline", "endpoint"

    def __init__(self):
        self.requests, self.metrics = [], []

    def request(self, r):
        self.requests.append(r)

    def metric(self, m):
        self.metrics.append(m)

    def advance(self, n=1):
        pass

    def is_done(self, key):
        return False

    def value(self, name):
        return next(m.value for m in self.metrics if m.name == name)


def test_arrivals_have_the_asked_rate_and_burstiness():
    poisson = np.array(arrival_gaps(4000, rate=5.0, burstiness=1.0, seed=0))
    bursty = np.array(arrival_gaps(4000, rate=5.0, burstiness=0.25, seed=0))
    assert poisson.mean() == pytest.approx(0.2, rel=0.08)
    assert bursty.mean() == pytest.approx(0.2, rel=0.15)
    cv = lambda x: x.std() / x.mean()  # noqa: E731
    assert cv(poisson) == pytest.approx(1.0, rel=0.1) and cv(bursty) == pytest.approx(2.0, rel=0.15)


def test_prompts_are_deterministic_distinct_and_share_the_prefix():
    a = make_prompts(5, 40, 30, seed=1)
    assert a == make_prompts(5, 40, 30, seed=1) and len(set(a)) == 5
    prefix = " ".join(a[0].split()[:30])
    assert all(p.startswith(prefix) for p in a)


def test_prompt_lengths_spread_over_the_asked_range():
    lengths = prompt_lengths(400, 16, 4096, seed=3)
    assert lengths == prompt_lengths(400, 16, 4096, seed=3) and min(lengths) >= 16 and max(lengths) <= 4096
    logs = np.log(lengths)  # log-uniform: every octave about as likely
    assert np.mean(np.array(lengths) < 256) == pytest.approx(0.5, abs=0.08)
    assert logs.std() == pytest.approx(np.log(4096 / 16) / np.sqrt(12), rel=0.1)
    prompts = make_prompts(50, 16, 0, seed=3, input_len_max=512)
    words = [len(p.split()) - 1 for p in prompts]  # less the "[i]" tag
    assert words == prompt_lengths(50, 16, 512, seed=3) and len(set(words)) > 30
    assert make_prompts(5, 40, 0, seed=1) == make_prompts(5, 40, 0, seed=1, input_len_max=None)


def test_length_range_is_checked_and_sizes_the_feasibility_bound():
    with pytest.raises(ValidationError, match="input_len_max 16 must be above input_len 16"):
        EndpointWorkload(input_len=16, input_len_max=16)
    w = EndpointWorkload(input_len=16, input_len_max=4096, output_len=8)
    assert EndpointRunner().min_request_tokens(w, SamplingSpec()) == 4104


def test_workload_refuses_two_arrival_modes():
    with pytest.raises(ValidationError, match="either concurrency"):
        EndpointWorkload(concurrency=4, request_rate=2.0)


def test_metrics_diff_gives_run_acceptance_not_lifetime_totals():
    before = parse_prometheus('vllm:spec_decode_num_drafts_total{model_name="m"} 10\n'
                              'vllm:spec_decode_num_draft_tokens_total{model_name="m"} 40\n'
                              'vllm:spec_decode_num_accepted_tokens_total{model_name="m"} 20\n'
                              'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="0"} 9\n')
    after = parse_prometheus('vllm:spec_decode_num_drafts_total{model_name="m"} 20\n'
                             'vllm:spec_decode_num_draft_tokens_total{model_name="m"} 80\n'
                             'vllm:spec_decode_num_accepted_tokens_total{model_name="m"} 50\n'
                             'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="0"} 17\n'
                             'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="1"} 6\n')
    spec = spec_acceptance(metrics_delta(before, after))
    assert spec["num_drafts"] == 10 and spec["acceptance_rate"] == pytest.approx(30 / 40)
    assert spec["mean_acceptance_length"] == pytest.approx(4.0)
    assert spec["accepted_per_position"] == [8, 6]


@pytest.fixture(scope="module")
def onecat_adapter():
    from onecat.gates.engines.onecat_engine import OnecatEngine

    arm = ArmSettings(name="baseline", model=ModelSpec(source=EMBEDDED),
                      engine=EngineSpec(max_model_len=512, max_num_seqs=8))
    eng = OnecatEngine.open(arm, 0)
    yield eng
    eng.close()


def test_endpoint_runner_on_the_in_process_engine(onecat_adapter):
    w = EndpointWorkload(api="completions", input_len=24, output_len=6, num_requests=6, concurrency=3,
                         warmup_requests=1, slo={"ttft_s": 60.0})
    runner, sink = EndpointRunner(), ListSink()
    units = runner.plan(w, SamplingSpec(), [0])
    assert [u.key for u in units] == ["seed=0/rep=0"]
    runner.run_unit(onecat_adapter, w, SamplingSpec(), units[0], sink)
    assert len(sink.requests) == 6
    assert all(r.error is None and r.num_completion_tokens == 6 and r.ttft_s > 0 for r in sink.requests)
    assert all(r.e2e_s >= r.ttft_s for r in sink.requests)
    assert sink.value("num_failed") == 0 and sink.value("slo_attainment") == 1.0
    assert sink.value("output_tok_s") > 0 and sink.value("ttft_p90_s") >= sink.value("ttft_p50_s")
    # the loopback server has given the engine back: it still works in-process
    from onecat.engine import SamplingParams

    assert onecat_adapter.generate(["Hello"], SamplingParams(max_tokens=2, temperature=0))[0].token_ids


def test_openai_backend_reports_an_unreachable_url():
    from onecat.gates.engines.openai_engine import OpenAIEndpointEngine

    arm = ArmSettings(name="baseline", model=ModelSpec(source="m"),
                      engine=EngineSpec(backend="openai", base_url="http://127.0.0.1:9"))
    [problem] = OpenAIEndpointEngine.check(arm)
    assert "cannot reach http://127.0.0.1:9" in problem
    arm2 = ArmSettings(name="baseline", model=ModelSpec(source="m"), engine=EngineSpec(backend="openai"))
    assert "base_url is required" in OpenAIEndpointEngine.check(arm2)[0]


@pytest.mark.slow
def test_managed_onecat_serve_backend_round_trip(tmp_path):
    """Start `onecat serve` as the harness does, generate/chat/score through it, stop it, keep its log."""
    from onecat.engine import SamplingParams
    from onecat.gates.engines.base import open_engine

    arm = ArmSettings(name="candidate", model=ModelSpec(source=EMBEDDED),
                      engine=EngineSpec(backend="onecat_serve", max_model_len=512, max_num_seqs=4,
                                        options={"log_dir": str(tmp_path)}))
    eng = open_engine(arm, 0)
    try:
        out = eng.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=4))[0]
        assert out.finish_reason == "length" and len(out.token_ids) == 4 and out.timings.first_token_s > 0
        assert eng.tokenizer.decode(out.token_ids) == out.text
        chat = eng.chat([[{"role": "user", "content": "Hi"}]], SamplingParams(temperature=0, max_tokens=3))[0]
        assert chat.text and len(chat.token_ids) == 3
        score = eng.score(["The capital of France is Paris"])[0]
        assert len(score.logprobs) == len(score.prompt_token_ids) - 1 and all(x <= 0 for x in score.logprobs)
    finally:
        eng.close()
    assert not eng.process.alive
    assert (tmp_path / "onecat_serve.log").read_text().startswith("$ ")
