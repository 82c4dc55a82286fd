"""OpenAI request bodies <-> SamplingParams, in one place for both sides of the HTTP API.

The server turns a validated request body into the engine's SamplingParams (`params_from_body`: a
field left out takes the engine's default, choice j of n samples with seed + j). The harness's HTTP
clients (gates/engines/openai_engine.py, gates/runners/endpoint.py) turn the SamplingParams their
runners build into the body fields of a request (`body_fields`), so a setting means the same on an
in-process engine and behind an endpoint.
"""
from __future__ import annotations

from typing import Any

from onecat.engine.sampling_params import GREEDY_BELOW, InvalidRequestError, SamplingParams
from onecat.engine.server.errors import ApiError

# Body fields that become SamplingParams settings of the same name; unset (None) ones keep the engine's default.
DEFAULTED_SETTINGS = ("temperature", "top_p", "top_k", "min_p")
# Settings every body states even at their default: servers fill in their own (a model's generation config,
# the rest of the context for max_tokens) where SamplingParams has another.
ALWAYS_SENT = ("temperature", "top_p", "max_tokens", "ignore_eos", "skip_special_tokens")
# Settings sent only when set: a seed when given (0 is a seed), the others when not 0, false or empty (which is
# the servers' default too).
SENT_WHEN_SET = ("top_k", "min_p", "min_tokens", "seed", "stop", "stop_token_ids", "include_stop_str_in_output")


def params_from_body(req: Any, max_tokens: int | None, choice: int, *, logprobs: int | None,
                     prompt_logprobs: int | None, processors: list | None) -> SamplingParams:
    """The engine settings of choice `choice` of a /v1/completions or /v1/chat/completions body (protocol.py),
    with its resolved `max_tokens`, logprobs and grammar processors; ApiError(400) when the engine refuses them."""
    given = {name: getattr(req, name) for name in DEFAULTED_SETTINGS if getattr(req, name) is not None}
    if "temperature" in given and given["temperature"] < GREEDY_BELOW:
        given["temperature"] = 0.0
    seed = req.seed + choice if req.seed is not None else None
    try:
        return SamplingParams(
            **given, seed=seed % 2**63 if seed is not None else None, max_tokens=max_tokens,
            min_tokens=req.min_tokens, stop=req.stop, stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos,
            include_stop_str_in_output=req.include_stop_str_in_output, logprobs=logprobs,
            prompt_logprobs=prompt_logprobs, skip_special_tokens=req.skip_special_tokens,
            logits_processors=processors or [])
    except InvalidRequestError as exc:
        raise ApiError(400, str(exc)) from None


def body_fields(params: SamplingParams) -> dict[str, Any]:
    """The request-body fields that ask an OpenAI-compatible server for `params`' sampling."""
    body = {name: getattr(params, name) for name in ALWAYS_SENT}
    for name in SENT_WHEN_SET:
        value = getattr(params, name)
        is_set = value is not None if name == "seed" else bool(value)
        if is_set:
            body[name] = list(value) if isinstance(value, list) else value
    return body
