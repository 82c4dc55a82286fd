"""Starting the server: blocking (`serve`, for the CLI) or on a background thread (tests, benchmarks).

Both paths build uvicorn's config with http_limits.uvicorn_config, so the header deadline,
keep-alive, connection limit and header size limit hold wherever the server runs.
"""
from __future__ import annotations

import json
import socket
import sys
import threading
import time
from dataclasses import dataclass

import uvicorn

from onecat.engine.server.app import ServerState, build_app
from onecat.engine.server.http_limits import uvicorn_config
from onecat.engine.server.serve_config import ServeConfig


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


# the line `serve` writes once the model is loaded: what the engine runs with (LLM.info()), as JSON, so that
# whoever started the server (the harness's onecat_serve backend) can record it from the server's log
ENGINE_INFO_PREFIX = "onecat serve: engine info "


def serve(config: ServeConfig, log_level: str = "info") -> None:
    """Load the model, then serve until interrupted."""
    state = ServerState.create(config)
    try:
        print(ENGINE_INFO_PREFIX + json.dumps(state.llm.info(), default=str), file=sys.stderr, flush=True)
    except Exception as exc:  # noqa: BLE001 - a report, never a reason not to serve
        print(f"{ENGINE_INFO_PREFIX}unavailable: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
    try:
        uvicorn.Server(uvicorn_config(build_app(state), config, host=config.host, port=config.port,
                                      log_level=log_level, timeout_graceful_shutdown=5)).run()
    finally:
        try:
            state.close()
        finally:
            state.llm.close()  # frees the model now, and stops tensor-parallel ranks politely


@dataclass
class BackgroundServer:
    state: ServerState
    server: uvicorn.Server
    thread: threading.Thread
    url: str

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(15)
        self.state.close()


def start_in_thread(state: ServerState, host: str = "127.0.0.1", port: int | None = None,
                    log_level: str = "warning", timeout: float = 30.0) -> BackgroundServer:
    """Serve `state` on a daemon thread; returns once the socket accepts connections."""
    port = port or free_port(host)
    config = uvicorn_config(build_app(state), state.config, host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=2)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="onecat-uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"the server did not start on {host}:{port}")
        time.sleep(0.02)
    return BackgroundServer(state, server, thread, f"http://{host}:{port}")
