"""Fixtures for server tests on the tiny chat model: in-process (ASGI) clients and live servers.

Import the fixtures into a test module (`from tests.server_fixtures import tiny_chat_dir, ...`).
Every engine opened here is closed in the fixture's teardown.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import pytest

from tests.tiny_server_model import make_tiny_chat_model

MODEL_NAME = "tiny"
MAX_MODEL_LEN = 96


@pytest.fixture(scope="session")
def tiny_chat_dir(tmp_path_factory):
    return make_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat"))


@contextlib.contextmanager
def tiny_state(model_dir, **config) -> Iterator:
    """A ServerState over the tiny model; its engine thread, worker threads and model are freed on exit."""
    from onecat.engine.server.app import ServeConfig, ServerState

    kw = dict(model=str(model_dir), served_model_name=[MODEL_NAME], max_model_len=MAX_MODEL_LEN, max_num_seqs=8,
              max_queue_len=32, device="cpu", llm_kwargs={"num_kv_blocks": 64})
    kw.update(config)
    state = ServerState.create(ServeConfig(**kw))
    try:
        yield state
    finally:
        state.close()
        state.llm.close()


@contextlib.contextmanager
def asgi_client(state) -> Iterator:
    """The app driven in-process (no sockets): fast enough for hundreds of requests."""
    from starlette.testclient import TestClient

    from onecat.engine.server.app import build_app

    with TestClient(build_app(state), raise_server_exceptions=False) as client:
        yield client


@contextlib.contextmanager
def live_server(state) -> Iterator:
    """The app behind uvicorn on a loopback port, with every HTTP limit of state.config."""
    from onecat.engine.server.launch import start_in_thread

    srv = start_in_thread(state)
    try:
        yield srv
    finally:
        srv.server.should_exit = True
        srv.thread.join(15)


def assert_openai_error(response, status: int | None = None) -> dict:
    """A 4xx (or exactly `status`) with the OpenAI error body; returns the error object."""
    assert 400 <= response.status_code < 500, (response.status_code, response.text[:500])
    if status is not None:
        assert response.status_code == status, (response.status_code, response.text[:500])
    err = response.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["code"] == response.status_code and err["message"] and err["type"]
    return err
