"""Connection-level limits: a deadline for the request line and headers, the uvicorn settings
that bound connections, idle keep-alive and header size, and OpenAI error bodies for uvicorn's own
refusals.

uvicorn has no header-read timeout: its keep-alive timer starts only after a response and is
cancelled by any byte received, so a client that opens a connection and sends nothing, or trickles
a header byte every few seconds (slowloris), holds the connection forever. `HeaderDeadline` closes
a connection when no request has started `request_header_timeout` seconds after the connection
opened or after its last response; a request whose headers arrived is never cut by it (the body
has its own deadline, enforced by the ASGI guard in http_guard.py).

uvicorn answers its own refusals in plain text: the `--limit-concurrency` 503 and the 400 for a
request it cannot parse, headers past h11's buffer limit among them. `OpenAIRefusals` answers them
with the `{"error": {...}}` body every other error carries, and the header overflow with 431.
"""
from __future__ import annotations

import asyncio
import json
import logging
from http import HTTPStatus
from typing import Any

import uvicorn
from uvicorn.config import HTTP_PROTOCOLS
from uvicorn.importer import import_from_string

from onecat.engine.server.errors import error_body
from onecat.engine.server.http_guard import headers_too_large, refuse

log = logging.getLogger("uvicorn.error")


class HeaderDeadline:
    """Mixin for uvicorn's HTTP protocol classes (h11, httptools): they all keep `transport`,
    `loop`, the current request's `cycle`, and call `on_response_complete` after each response."""

    header_timeout: float = 10.0
    _header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)
        self._arm_header_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm_header_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
        super().connection_lost(exc)

    def _arm_header_deadline(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
        waiting_after = getattr(self, "cycle", None)
        self._header_timer = self.loop.call_later(self.header_timeout, self._header_deadline_passed, waiting_after)

    def _header_deadline_passed(self, waiting_after: Any) -> None:
        cycle = getattr(self, "cycle", None)
        request_in_progress = cycle is not None and not cycle.response_complete
        if cycle is waiting_after and not request_in_progress and not self.transport.is_closing():
            self.transport.close()


def _busy_app(limit: int) -> Any:
    async def busy(scope: Any, receive: Any, send: Any) -> None:
        await refuse(send, 503, f"the server is at its limit of {limit} open connections and requests in "
                                "progress (--limit-concurrency); retry later, or start it with a higher "
                                "--limit-concurrency", [(b"retry-after", b"1")])
    return busy


def _raw_error(status: int, message: str) -> bytes:
    """A whole HTTP/1.1 error answer, for refusals made before any request exists."""
    body = json.dumps(error_body(message, status)).encode()
    head = (f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n")
    return head.encode("ascii") + body


class OpenAIRefusals:
    """Mixin for uvicorn's HTTP protocol classes: their `limit_concurrency` check and `send_400_response`
    answer with the OpenAI error body. The protocol reads `self.app` once per request, right where
    uvicorn would check the limit, so the property below makes the same check and hands out the
    503 app instead of the real one."""

    concurrency_limit: int | None = None
    header_limit: int = 16 * 1024

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.limit_concurrency = None  # checked in `app`, so the 503 is ours

    @property
    def app(self) -> Any:
        limit = self.concurrency_limit
        if limit is not None and (len(self.connections) >= limit or len(self.tasks) >= limit):
            log.warning("Exceeded concurrency limit.")
            return _busy_app(limit)
        return self._app

    @app.setter
    def app(self, value: Any) -> None:
        self._app = value

    def send_400_response(self, msg: str) -> None:
        """h11 raises the same error for a malformed request and for headers past its buffer limit;
        the buffer's size tells them apart."""
        buffered = getattr(getattr(self, "conn", None), "trailing_data", (b"",))[0]
        if len(buffered) > self.header_limit:
            answer = _raw_error(431, headers_too_large(self.header_limit))
        else:
            answer = _raw_error(400, "invalid HTTP request: the request line or headers could not be parsed")
        self.transport.write(answer)
        self.transport.close()


def guarded_protocol(header_timeout: float, http: str = "auto", *, concurrency_limit: int | None = None,
                     header_limit: int = 16 * 1024) -> type:
    """uvicorn's HTTP protocol class for `http` ("auto", "h11", "httptools") with the header deadline
    and OpenAI-style refusals."""
    base = import_from_string(HTTP_PROTOCOLS[http])
    return type(f"Guarded{base.__name__}", (HeaderDeadline, OpenAIRefusals, base),
                {"header_timeout": float(header_timeout), "concurrency_limit": concurrency_limit,
                 "header_limit": header_limit})


def uvicorn_config(app: Any, config: Any, *, host: str, port: int, log_level: str, **extra: Any) -> uvicorn.Config:
    """The uvicorn.Config for `onecat serve` and for in-process servers alike, with every limit of `config`
    (an app.ServeConfig) applied."""
    http = guarded_protocol(config.request_header_timeout, concurrency_limit=config.limit_concurrency,
                            header_limit=config.h11_max_incomplete_event_size)
    kw: dict[str, Any] = dict(host=host, port=port, log_level=log_level, http=http,
                              timeout_keep_alive=config.timeout_keep_alive,
                              limit_concurrency=config.limit_concurrency,
                              h11_max_incomplete_event_size=config.h11_max_incomplete_event_size)
    kw.update(extra)
    return uvicorn.Config(app, **kw)
