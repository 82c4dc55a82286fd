"""The server cannot be stalled: huge bodies, slow (slowloris) and idle connections, connection floods.

These run uvicorn on a loopback port, since what they test lives below the app: header and body
deadlines, keep-alive, the connection limit, and an event loop left free while a worker thread
tokenizes.
"""
from __future__ import annotations

import json
import selectors
import socket
import threading
import time

import httpx
import pytest

from tests.server_fixtures import MODEL_NAME, live_server, tiny_chat_dir, tiny_state  # noqa: F401

HEADER_TIMEOUT, BODY_TIMEOUT, KEEP_ALIVE = 1.0, 2.0, 1.0


@pytest.fixture(scope="module")
def state(tiny_chat_dir):  # noqa: F811
    with tiny_state(tiny_chat_dir, request_header_timeout=HEADER_TIMEOUT, request_body_timeout=BODY_TIMEOUT,
                    timeout_keep_alive=KEEP_ALIVE) as st:
        yield st


@pytest.fixture(scope="module")
def server(state):
    with live_server(state) as srv:
        yield srv


def _address(server) -> tuple[str, int]:
    host, port = server.url.removeprefix("http://").split(":")
    return host, int(port)


def _open(server) -> socket.socket:
    s = socket.create_connection(_address(server), timeout=5)
    s.setblocking(False)
    return s


def _closed_by_server(sockets: list[socket.socket], within: float) -> int:
    """How many of `sockets` the server closed (EOF or reset) within `within` seconds."""
    sel = selectors.DefaultSelector()
    for s in sockets:
        sel.register(s, selectors.EVENT_READ)
    closed, deadline = 0, time.monotonic() + within
    while closed < len(sockets) and time.monotonic() < deadline:
        for key, _ in sel.select(timeout=0.1):
            try:
                data = key.fileobj.recv(65536)
            except ConnectionError:
                data = b""
            if not data:
                sel.unregister(key.fileobj)
                closed += 1
    sel.close()
    return closed


def _health_ms(server) -> float:
    t0 = time.perf_counter()
    assert httpx.get(server.url + "/health", timeout=30).status_code == 200
    return (time.perf_counter() - t0) * 1e3


# --------------------------------------------------------------------------- CPU work off the event loop
def test_huge_tokenize_does_not_stall_the_event_loop(server):
    prompt = "The quick brown fox jumps over the lazy dog. " * 40_000  # 1.8 MB
    result: dict = {}

    def tokenize():
        t0 = time.perf_counter()
        r = httpx.post(server.url + "/tokenize", json={"prompt": prompt}, timeout=120)
        result.update(status=r.status_code, count=r.json().get("count"), seconds=time.perf_counter() - t0)

    worker = threading.Thread(target=tokenize)
    worker.start()
    time.sleep(0.3)  # the body is in and the tokenizer busy
    latencies = []
    while worker.is_alive():
        latencies.append(_health_ms(server))
        time.sleep(0.02)
    worker.join()
    assert result["status"] == 200 and result["count"] > 100_000
    assert latencies, "the tokenize request finished before /health could be asked"
    assert max(latencies) < 500, f"/health waited {max(latencies):.0f} ms while /tokenize ran {result['seconds']:.1f} s"


def test_unauthenticated_huge_body_is_refused_before_it_is_read(server, state):
    state.config.api_key = "sekret"
    try:
        t0 = time.perf_counter()
        r = httpx.post(server.url + "/tokenize", content=b'{"prompt": "' + b"x" * 6_000_000 + b'"}', timeout=60)
        assert r.status_code == 401
        assert time.perf_counter() - t0 < 5
    finally:
        state.config.api_key = None


# --------------------------------------------------------------------------- slow and idle connections
def test_slowloris_connections_are_closed_after_the_header_timeout(server):
    sockets = [_open(server) for _ in range(300)]
    try:
        for s in sockets:
            s.send(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        start = time.monotonic()
        trickled = 0
        while time.monotonic() - start < HEADER_TIMEOUT + 0.5:  # one header byte now and then, never the end
            for s in sockets:
                try:
                    s.send(b"X")
                except OSError:
                    pass
            trickled += 1
            time.sleep(0.2)
        assert _health_ms(server) < 2000  # still answering while they hang on
        assert _closed_by_server(sockets, within=HEADER_TIMEOUT + 4) == len(sockets)
    finally:
        for s in sockets:
            s.close()
    assert trickled >= 5


def test_silent_connection_is_closed_after_the_header_timeout(server):
    s = _open(server)
    try:
        t0 = time.monotonic()
        assert _closed_by_server([s], within=HEADER_TIMEOUT + 4) == 1
        assert time.monotonic() - t0 >= HEADER_TIMEOUT * 0.8
    finally:
        s.close()


def test_idle_keep_alive_connection_is_closed(server):
    s = _open(server)
    try:
        s.setblocking(True)
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert s.recv(65536).startswith(b"HTTP/1.1 200")
        s.setblocking(False)
        assert _closed_by_server([s], within=KEEP_ALIVE + 4) == 1
    finally:
        s.close()


def test_slow_body_within_its_deadline_is_served(server):
    """The header deadline never cuts a request whose headers arrived; the body has its own deadline."""
    body = b'{"prompt": "hello world"}'
    s = _open(server)
    try:
        s.setblocking(True)
        s.sendall(b"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n" % len(body))
        for k in range(0, len(body), 5):  # over 1.5 s: longer than the header timeout, shorter than the body's
            s.sendall(body[k:k + 5])
            time.sleep(1.5 / (len(body) / 5))
        s.settimeout(10)
        assert s.recv(65536).startswith(b"HTTP/1.1 200")
    finally:
        s.close()


def test_body_trickled_past_its_deadline_is_408(server):
    s = _open(server)
    try:
        s.setblocking(True)
        s.sendall(b"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{")
        s.settimeout(BODY_TIMEOUT + 5)
        t0 = time.monotonic()
        answer = b""
        while b"\r\n\r\n" not in answer:
            answer += s.recv(65536)
            s.send(b" ")
        assert answer.startswith(b"HTTP/1.1 408")
        assert BODY_TIMEOUT * 0.8 <= time.monotonic() - t0 < BODY_TIMEOUT + 5
    finally:
        s.close()


def _error_of(response) -> dict:
    """The OpenAI error object of `response` (every refusal carries one)."""
    assert response.headers["content-type"] == "application/json", response.text[:300]
    err = response.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == response.status_code, err
    return err


@pytest.mark.parametrize("header_bytes", [17_000, 100_000])
def test_headers_over_the_size_limit_get_431(server, header_bytes):
    """Headers that arrive whole are held to --h11-max-incomplete-event-size (16 KiB) too, not only
    those still incomplete in h11's buffer."""
    r = httpx.get(server.url + "/health", headers={"X-Big": "x" * header_bytes}, timeout=10)
    assert r.status_code == 431, (r.status_code, r.text[:300])
    assert "16384 bytes" in _error_of(r)["message"] and "--h11-max-incomplete-event-size" in r.text


def test_headers_under_the_size_limit_pass(server):
    assert httpx.get(server.url + "/health", headers={"X-Big": "x" * 15_000}, timeout=10).status_code == 200


def test_headers_growing_past_the_size_limit_are_refused(server):
    """A connection cannot buffer unbounded header bytes (h11's incomplete-event limit, 16 KiB)."""
    s = _open(server)
    try:
        s.setblocking(True)
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: ")
        answer = b""
        for _ in range(16):  # 64 KiB in 4 KiB pieces
            try:
                s.sendall(b"x" * 4096)
            except OSError:
                break
            time.sleep(0.02)
        s.settimeout(5)
        try:
            answer = s.recv(65536)
        except OSError:
            pass
        assert answer.startswith(b"HTTP/1.1 431") or answer == b"", answer[:300]
    finally:
        s.close()


def test_unparsable_request_gets_400_with_the_error_body(server):
    s = _open(server)
    try:
        s.setblocking(True)
        s.sendall(b"GARBAGE\x00 / HTTP/1.1\r\n\r\n")
        s.settimeout(5)
        head, _, body = s.recv(65536).partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 400") and b"content-type: application/json" in head, head
        assert json.loads(body)["error"]["code"] == 400
    finally:
        s.close()


# --------------------------------------------------------------------------- connection limit
def test_connection_flood_gets_503_until_the_idle_connections_are_closed(state):
    saved = state.config.limit_concurrency
    state.config.limit_concurrency = 10
    try:
        with live_server(state) as srv:
            idle = [_open(srv) for _ in range(12)]
            try:
                time.sleep(0.2)
                refused = httpx.get(srv.url + "/health", timeout=10)
                assert refused.status_code == 503
                message = _error_of(refused)["message"]
                assert "--limit-concurrency" in message and "retry" in message, message
                assert _closed_by_server(idle, within=HEADER_TIMEOUT + 4) == len(idle)
            finally:
                for s in idle:
                    s.close()
            assert httpx.get(srv.url + "/health", timeout=10).status_code == 200
    finally:
        state.config.limit_concurrency = saved


# --------------------------------------------------------------------------- flags
def test_serve_flags_reach_the_server_config(monkeypatch):
    from typer.testing import CliRunner

    import onecat.engine.server.launch as launch
    from onecat.cli.serve import app

    seen = {}
    monkeypatch.setattr(launch, "serve", lambda cfg, log_level: seen.update(cfg=cfg))
    r = CliRunner().invoke(app, ["some-model", "--api-key", "k", "--metrics-without-auth",
                                 "--max-request-body-bytes", "1000", "--request-header-timeout", "3",
                                 "--request-body-timeout", "4", "--timeout-keep-alive", "2", "--limit-concurrency", "0",
                                 "--h11-max-incomplete-event-size", "8192"])
    assert r.exit_code == 0, r.output
    cfg = seen["cfg"]
    assert (cfg.api_key, cfg.metrics_without_auth, cfg.max_request_body_bytes) == ("k", True, 1000)
    assert (cfg.request_header_timeout, cfg.request_body_timeout, cfg.timeout_keep_alive) == (3, 4, 2)
    assert cfg.limit_concurrency is None and cfg.h11_max_incomplete_event_size == 8192
    for bad in (["--request-header-timeout", "0"], ["--max-request-body-bytes", "-1"], ["--limit-concurrency", "-2"]):
        assert CliRunner().invoke(app, ["some-model", *bad]).exit_code == 2


def test_default_limits():
    from onecat.engine.server.app import ServeConfig

    cfg = ServeConfig(model="m")
    assert cfg.api_key is None and not cfg.metrics_without_auth
    assert cfg.max_request_body_bytes == 16 * 2**20 and cfg.limit_concurrency == 2048
    assert (cfg.request_header_timeout, cfg.request_body_timeout, cfg.timeout_keep_alive) == (10, 60, 5)
    assert cfg.h11_max_incomplete_event_size == 16 * 1024
