"""Property: no request body, however malformed, gets a 5xx; every refusal is an OpenAI error body.

Hypothesis draws bodies for every POST endpoint (server_strategies.py) and sends them to the app
in-process, on the tiny chat model. The default run is bounded to well under a minute; the
`slow` variant draws many more.
"""
from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.server_fixtures import asgi_client, assert_openai_error, tiny_chat_dir, tiny_state  # noqa: F401
from tests.server_strategies import BODIES, damaged

ENDPOINTS = list(BODIES)
_no_nan = {"parse_constant": lambda name: pytest.fail(f"{name} in a response: not strict JSON")}


@pytest.fixture(scope="module")
def client(tiny_chat_dir):  # noqa: F811
    with tiny_state(tiny_chat_dir, max_queue_len=64) as state, asgi_client(state) as c:
        yield c
        assert c.get("/health").status_code == 200
        assert state.engine.num_in_flight == 0


def check_answer(response) -> None:
    """No 5xx; a refusal carries the OpenAI error body; a success is strict JSON (or SSE of it)."""
    assert response.status_code < 500, response.text[:1000]
    if response.status_code >= 400:
        assert_openai_error(response)
        return
    assert response.status_code == 200, response.text[:1000]
    if response.headers["content-type"].startswith("text/event-stream"):
        events = [line[len("data: "):] for line in response.text.splitlines() if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", response.text[-500:]
        for event in events[:-1]:
            body = json.loads(event, **_no_nan)
            assert "error" not in body or body["error"]["code"] < 500, body
    else:
        json.loads(response.text, **_no_nan)


def post(client, path: str, raw: bytes):
    return client.post(path, content=raw, headers={"content-type": "application/json"})


def _fuzz(max_examples: int, derandomize: bool):
    return settings(max_examples=max_examples, derandomize=derandomize, database=None, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.function_scoped_fixture])


@pytest.mark.parametrize("path", ENDPOINTS)
def test_no_body_gets_a_5xx(client, path):
    @_fuzz(max_examples=200 if path.startswith("/v1") else 100, derandomize=True)
    @given(raw=damaged(BODIES[path]))
    def run(raw):
        check_answer(post(client, path, raw))

    run()


@_fuzz(max_examples=100, derandomize=True)
@given(path=st.sampled_from(ENDPOINTS), raw=st.binary(max_size=64))
def test_no_byte_string_gets_a_5xx(client, path, raw):
    check_answer(post(client, path, raw))


@pytest.mark.slow
@pytest.mark.parametrize("path", ENDPOINTS)
def test_no_body_gets_a_5xx_long_run(client, path):
    @_fuzz(max_examples=2000, derandomize=False)
    @given(raw=damaged(BODIES[path]))
    def run(raw):
        check_answer(post(client, path, raw))

    run()
