"""SamplingParams is the one declaration of sampling: the contract's `sampling` block and the server's request
bodies take their bounds and help from it, and engine/server/sampling_body.py converts both ways, so what a
client writes is what the server reads back."""
import pytest

from onecat.engine.sampling_params import GREEDY_BELOW, SamplingParams, setting
from onecat.engine.server.errors import ApiError
from onecat.engine.server.protocol import ChatCompletionRequest, CompletionRequest
from onecat.engine.server.sampling_body import body_fields, params_from_body
from onecat.gates.contract import SAMPLING_IN_CONTRACT, SamplingSpec
from onecat.gates.runners.base import to_sampling_params

NARROWER_IN_CONTRACT = {"max_tokens": {"ge": 1}}  # the natural-EOS cap is a number of at least one token


def _constraints(field) -> dict:
    out = {}
    for c in field.metadata:
        out.update({k: getattr(c, k) for k in ("ge", "gt", "le", "lt") if hasattr(c, k)})
    return out


@pytest.mark.parametrize("name", SAMPLING_IN_CONTRACT)
def test_contract_sampling_fields_are_sampling_params_settings(name):
    declared, field = setting(name), SamplingSpec.model_fields[name]
    assert field.description == declared.help
    assert _constraints(field) == {**declared.bounds.constraints(), **NARROWER_IN_CONTRACT.get(name, {})}


@pytest.mark.parametrize("model, name, setting_name", [
    (CompletionRequest, "temperature", "temperature"), (CompletionRequest, "top_p", "top_p"),
    (CompletionRequest, "top_k", "top_k"), (CompletionRequest, "min_p", "min_p"), (CompletionRequest, "seed", "seed"),
    (CompletionRequest, "min_tokens", "min_tokens"), (CompletionRequest, "max_tokens", "max_tokens"),
    (ChatCompletionRequest, "max_completion_tokens", "max_tokens")])
def test_request_bodies_take_the_declared_bounds(model, name, setting_name):
    assert _constraints(model.model_fields[name]) == setting(setting_name).bounds.constraints()


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0, max_tokens=8),
    SamplingParams(temperature=0.7, top_p=0.9, top_k=20, min_p=0.05, seed=0, max_tokens=64, stop=["\n\n"]),
    SamplingParams(temperature=1.0, seed=12, max_tokens=4, min_tokens=2, ignore_eos=True, stop_token_ids=[7],
                   include_stop_str_in_output=True, skip_special_tokens=False),
])
@pytest.mark.parametrize("model, prompt", [(CompletionRequest, {"prompt": "hi"}),
                                           (ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi"}]})])
def test_a_body_written_from_params_reads_back_as_the_same_params(params, model, prompt):
    req = model.model_validate({**prompt, **body_fields(params)})
    assert params_from_body(req, req.max_tokens, 0, logprobs=None, prompt_logprobs=None, processors=None) == params


def test_choices_get_consecutive_seeds_and_tiny_temperatures_are_greedy():
    req = CompletionRequest.model_validate({"prompt": "hi", "seed": 2**63 - 1, "temperature": GREEDY_BELOW / 2})
    first, second = (params_from_body(req, 4, j, logprobs=None, prompt_logprobs=None, processors=None) for j in (0, 1))
    assert (first.seed, second.seed) == (2**63 - 1, 0)
    assert first.temperature == 0.0 and first.greedy


def test_settings_the_engine_refuses_are_a_400():
    req = CompletionRequest.model_validate({"prompt": "hi", "stop": [""]})
    with pytest.raises(ApiError) as exc:
        params_from_body(req, 4, 0, logprobs=None, prompt_logprobs=None, processors=None)
    assert exc.value.status == 400 and "stop strings must be non-empty" in exc.value.message


def test_contract_sampling_carries_over_by_name():
    spec = SamplingSpec(temperature=0.6, top_p=0.95, top_k=-1, min_p=0.01, max_tokens=100, stop=["</s>"])
    assert to_sampling_params(spec, seed=3, ignore_eos=True) == SamplingParams(
        temperature=0.6, top_p=0.95, top_k=0, min_p=0.01, max_tokens=100, stop=["</s>"], seed=3, ignore_eos=True)
