"""Connection-level limits: a deadline for the request line and headers, and the uvicorn settings
that bound connections, idle keep-alive and header size.

uvicorn has no header-read timeout: its keep-alive timer starts only after a response and is
cancelled by any byte received, so a client that opens a connection and sends nothing, or trickles
a header byte every few seconds (slowloris), holds the connection forever. `HeaderDeadline` closes
a connection when no request has started `request_header_timeout` seconds after the connection
opened or after its last response; a request whose headers arrived is never cut by it (the body
has its own deadline, enforced by the ASGI guard in http_guard.py).
"""
from __future__ import annotations

import asyncio
from typing import Any

import uvicorn
from uvicorn.config import HTTP_PROTOCOLS
from uvicorn.importer import import_from_string


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


def guarded_protocol(header_timeout: float, http: str = "auto") -> type:
    """uvicorn's HTTP protocol class for `http` ("auto", "h11", "httptools") with the header deadline."""
    base = import_from_string(HTTP_PROTOCOLS[http])
    return type(f"HeaderDeadline{base.__name__}", (HeaderDeadline, base), {"header_timeout": float(header_timeout)})


def uvicorn_config(app: Any, config: Any, *, host: str, port: int, log_level: str, **extra: Any) -> uvicorn.Config:
    """The uvicorn.Config for `onecat serve` and for in-process servers alike, with every limit of `config`
    (an app.ServeConfig) applied."""
    kw: dict[str, Any] = dict(host=host, port=port, log_level=log_level,
                              http=guarded_protocol(config.request_header_timeout),
                              timeout_keep_alive=config.timeout_keep_alive,
                              limit_concurrency=config.limit_concurrency)
    if config.h11_max_incomplete_event_size is not None:
        kw["h11_max_incomplete_event_size"] = config.h11_max_incomplete_event_size
    kw.update(extra)
    return uvicorn.Config(app, **kw)
