"""Malformed and hostile requests: every one is a 4xx with an OpenAI error body, never a 500.

Each case below once gave a 500 (an exception escaping a handler) or was accepted although the
server cannot honour it. The app runs in-process on the tiny chat model.
"""
from __future__ import annotations

import json

import pytest

from tests.server_fixtures import MODEL_NAME, asgi_client, assert_openai_error, tiny_chat_dir, tiny_state  # noqa: F401

USER = [{"role": "user", "content": "hi"}]


def _j(obj) -> bytes:
    return json.dumps(obj).encode()


def _chat(**kw) -> bytes:
    return _j({"messages": USER, "max_tokens": 2, **kw})


def _cmpl(**kw) -> bytes:
    return _j({"prompt": "hi", "max_tokens": 2, **kw})


# (path, raw body): each must be a 4xx with the OpenAI error body
MALFORMED = {
    # text that is not Unicode: the tokenizer and the UTF-8 encoder both refuse lone surrogates
    "chat-lone-surrogate": ("/v1/chat/completions",
                            b'{"messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 2}'),
    "completion-lone-surrogate": ("/v1/completions", b'{"prompt": "a\\udfff", "max_tokens": 2}'),
    "surrogate-as-raw-bytes": ("/v1/completions", b'{"prompt": "x\xed\xa0\x80", "max_tokens": 2}'),
    "surrogate-in-model-name": ("/v1/completions", b'{"prompt": "x", "max_tokens": 2, "model": "\\ud800"}'),
    "surrogate-in-request-id": ("/v1/completions", b'{"prompt": "x", "max_tokens": 2, "request_id": "\\ud800"}'),
    "surrogate-in-stop": ("/v1/completions", b'{"prompt": "x", "max_tokens": 2, "stop": ["\\udc00"]}'),
    "tokenize-lone-surrogate": ("/tokenize", b'{"prompt": "\\ud800"}'),
    # numbers and nesting beyond what json.loads / int() / the stack take
    "deep-nesting": ("/v1/chat/completions", b'{"messages": ' + b"[" * 5000 + b"]" * 5000 + b"}"),
    "5000-digit-int": ("/v1/completions", b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}"),
    "temperature-Infinity": ("/v1/completions", b'{"prompt": "x", "max_tokens": 2, "temperature": Infinity}'),
    "temperature-NaN": ("/v1/completions", b'{"prompt": "x", "max_tokens": 2, "temperature": NaN}'),
    "temperature-string-inf": ("/v1/completions", _cmpl(temperature="Infinity")),
    "float-overflow": ("/v1/completions", b'{"prompt": "x", "max_tokens": 2, "top_p": 1e400}'),
    # ids outside the vocabulary
    "stop-token-ids-negative": ("/v1/completions", _cmpl(stop_token_ids=[-1])),
    "stop-token-ids-past-vocab": ("/v1/chat/completions", _chat(stop_token_ids=[10**6])),
    "guided-choice-empty": ("/v1/completions", _cmpl(guided_choice=[])),
    # nested objects of the wrong shape
    "tool-calls-garbage": ("/v1/chat/completions", _j({"messages": [
        {"role": "assistant", "content": "x", "tool_calls": "garbage"}], "max_tokens": 2})),
    "tool-calls-item-garbage": ("/v1/chat/completions", _j({"messages": [
        {"role": "assistant", "content": "x", "tool_calls": ["garbage"]}], "max_tokens": 2})),
    "tool-call-function-garbage": ("/v1/chat/completions", _j({"messages": [
        {"role": "assistant", "content": "x", "tool_calls": [{"function": "garbage"}]}], "max_tokens": 2})),
    "tools-function-garbage": ("/v1/chat/completions", _chat(tools=[{"type": "function", "function": "garbage"}])),
    "tool-choice-function-garbage": ("/v1/chat/completions", _chat(
        tools=[{"type": "function", "function": {"name": "f"}}], tool_choice={"function": "garbage"})),
    "response-format-json-schema-garbage": ("/v1/chat/completions", _chat(
        response_format={"type": "json_schema", "json_schema": "garbage"})),
    "tool-calls-true": ("/v1/chat/completions", _j({"messages": [{"role": "user", "tool_calls": True}],
                                                    "max_tokens": 1})),
    "text-part-not-a-string": ("/v1/chat/completions", _j({"messages": [
        {"role": "user", "content": [{"type": "text", "text": {"a": 1}}]}], "max_tokens": 2})),
    # /tokenize and /detokenize bodies
    "tokenize-not-json": ("/tokenize", b"garbage"),
    "tokenize-empty-body": ("/tokenize", b""),
    "tokenize-messages-null": ("/tokenize", b'{"messages": null}'),
    "tokenize-not-an-object": ("/tokenize", b"[]"),
    "tokenize-messages-garbage": ("/tokenize", b'{"messages": "garbage"}'),
    "tokenize-message-not-an-object": ("/tokenize", b'{"messages": [5]}'),
    "tokenize-prompt-not-a-string": ("/tokenize", b'{"prompt": {"a": 1}}'),
    "tokenize-no-prompt": ("/tokenize", b"{}"),
    "detokenize-not-json": ("/detokenize", b"garbage"),
    "detokenize-not-an-object": ("/detokenize", b"[]"),
    "detokenize-id-negative": ("/detokenize", b'{"tokens": [-1]}'),
    "detokenize-id-1e12-float": ("/detokenize", b'{"tokens": [1e12]}'),
    "detokenize-id-10^12": ("/detokenize", b'{"tokens": [1000000000000]}'),
    "detokenize-id-past-vocab": ("/detokenize", b'{"tokens": [100000]}'),
    "detokenize-id-fraction": ("/detokenize", b'{"tokens": [1.5]}'),
    "detokenize-id-null": ("/detokenize", b'{"tokens": [null]}'),
    "detokenize-id-list": ("/detokenize", b'{"tokens": [[1]]}'),
    "detokenize-tokens-string": ("/detokenize", b'{"tokens": "abc"}'),
    "detokenize-tokens-int": ("/detokenize", b'{"tokens": 5}'),
    "detokenize-no-tokens": ("/detokenize", b"{}"),
    "detokenize-unknown-model": ("/detokenize", b'{"tokens": [1], "model": "nope"}'),
    # more engine requests in one call than the server can ever hold
    "prompts-times-n-over-capacity": ("/v1/completions", _j({"prompt": ["x"] * 200, "n": 128, "max_tokens": 2})),
    "stop-string-too-long": ("/v1/completions", _cmpl(stop=["a" * 5000])),
}


@pytest.fixture(scope="module")
def client(tiny_chat_dir):  # noqa: F811
    with tiny_state(tiny_chat_dir) as state, asgi_client(state) as c:
        yield c


@pytest.mark.parametrize("path,body", list(MALFORMED.values()), ids=list(MALFORMED))
def test_malformed_request_is_a_4xx_with_an_openai_error(client, path, body):
    r = client.post(path, content=body, headers={"content-type": "application/json"})
    assert_openai_error(r)


def test_surrogate_error_names_the_field(client):
    r = client.post("/v1/chat/completions", content=MALFORMED["chat-lone-surrogate"][1])
    err = assert_openai_error(r, 400)
    assert "messages[0].content" in err["message"] and err["param"] == "messages"


def test_valid_requests_still_work(client):
    """The limits refuse only what is wrong: the same endpoints answer well-formed bodies."""
    assert client.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 2}).status_code == 200
    assert client.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 2, "stop_token_ids": [2],
                                                "temperature": 0.5, "guided_choice": ["yes", "no"]}).status_code == 200
    tokens = client.post("/tokenize", json={"prompt": "hello world"}).json()["tokens"]
    assert client.post("/detokenize", json={"tokens": tokens}).json()["prompt"] == "hello world"
    chat = client.post("/tokenize", json={"messages": USER}).json()
    assert chat["count"] == len(chat["tokens"]) > 0


def test_logprobs_under_a_grammar_are_finite_json(client):
    """Grammar-masked tokens have log-probability -inf, which strict JSON cannot carry."""
    r = client.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 3, "guided_choice": ["yes", "no"],
                                                  "logprobs": True, "top_logprobs": 20})
    assert r.status_code == 200, r.text
    json.loads(r.text, parse_constant=lambda name: pytest.fail(f"{name} in the response"))


def test_tiny_temperature_means_greedy(client):
    """Below 1e-5 the scaled logits overflow; vLLM treats such temperatures as greedy, so do we."""
    greedy = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4, "temperature": 0}).json()
    tiny = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4, "temperature": 1e-300}).json()
    assert tiny["choices"][0]["text"] == greedy["choices"][0]["text"]


# --------------------------------------------------------------------------- --api-key
PROTECTED = [("GET", "/v1/models"), ("GET", "/version"), ("GET", "/metrics"), ("GET", "/docs"),
             ("GET", "/openapi.json"), ("GET", "/redoc"), ("GET", "/no-such-route"),
             ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("POST", "/tokenize"),
             ("POST", "/detokenize")]


@pytest.fixture()
def keyed(client):
    state = client.app.state.onecat
    state.config.api_key = "sekret"
    try:
        yield client
    finally:
        state.config.api_key = None
        state.config.metrics_without_auth = False


@pytest.mark.parametrize("method,path", PROTECTED)
def test_api_key_guards_every_route(keyed, method, path):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekret"},
                    {"Authorization": "Bearer sekret2"}, {"Authorization": "bearer sekret"}):
        r = keyed.request(method, path, headers=headers, content=b'{"prompt": "hi"}')
        assert_openai_error(r, 401)
    r = keyed.request(method, path, headers={"Authorization": "Bearer sekret"},
                      content=b'{"prompt": "hi", "tokens": [1], "max_tokens": 1}')
    assert r.status_code != 401


def test_health_probes_stay_open_with_a_key(keyed):
    assert keyed.get("/health").status_code == 200
    assert keyed.get("/ping").status_code == 200


def test_metrics_open_only_behind_its_flag(keyed):
    assert keyed.get("/metrics").status_code == 401
    keyed.app.state.onecat.config.metrics_without_auth = True
    assert keyed.get("/metrics").status_code == 200
    assert keyed.get("/v1/models").status_code == 401  # the flag opens /metrics only


def test_key_is_compared_in_constant_time(monkeypatch):
    from onecat.engine.server import http_guard

    calls = []
    real = http_guard.hmac.compare_digest
    monkeypatch.setattr(http_guard.hmac, "compare_digest", lambda a, b: calls.append((a, b)) or real(a, b))
    assert http_guard.key_matches(b"Bearer k3y", "k3y")
    assert not http_guard.key_matches(b"Bearer k3", "k3y")
    assert not http_guard.key_matches(None, "k3y")
    assert len(calls) == 3 and all(len(a) == len(b) for a, b in calls)  # digests: lengths never differ


# --------------------------------------------------------------------------- body size
@pytest.fixture()
def small_body_limit(client):
    cfg = client.app.state.onecat.config
    saved = cfg.max_request_body_bytes
    cfg.max_request_body_bytes = 4096
    try:
        yield client
    finally:
        cfg.max_request_body_bytes = saved


def test_declared_body_over_the_limit_is_413(small_body_limit):
    r = small_body_limit.post("/tokenize", json={"prompt": "x" * 5000})
    assert_openai_error(r, 413)
    assert small_body_limit.post("/tokenize", json={"prompt": "x" * 3000}).status_code == 200


def test_chunked_body_over_the_limit_is_413(small_body_limit):
    def chunks():
        for _ in range(10):
            yield b" " * 1000

    r = small_body_limit.post("/tokenize", content=chunks())
    assert_openai_error(r, 413)
