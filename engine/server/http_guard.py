"""The ASGI guard in front of every route: header size cap, API key, body size cap and body read deadline.

Plain ASGI (not BaseHTTPMiddleware, which hides client disconnects from handlers). In order:

0. Request line + headers over `--h11-max-incomplete-event-size` bytes are a 431. h11 holds only
   headers still incomplete in its buffer to that size; whole headers that arrive in one read
   (asyncio reads up to 256 KiB at once) are measured here.
1. `--api-key`: every route but the health probes (`/health`, `/ping`) needs
   `Authorization: Bearer KEY`, compared in constant time; `/metrics` is open only with
   `--metrics-without-auth`. Checked before a byte of the body is read.
2. A declared `Content-Length` over `--max-request-body-bytes` is a 413 at once.
3. The body is read here, whole, within `--request-body-timeout` seconds (408 otherwise) and up to
   the cap (413), then handed to the app as one message; later `receive()` calls (disconnect
   checks) go to the server as before.

Refusals close the connection, since the rest of the body was never read.
"""
from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
from typing import Any

from onecat.engine.server.errors import error_body

OPEN_ROUTES = frozenset({"/health", "/ping"})


def _digest(value: bytes) -> bytes:
    return hashlib.sha256(value).digest()


def key_matches(authorization: bytes | None, key: str) -> bool:
    """Constant time in the key and the header (both are hashed first, so even lengths do not leak)."""
    expected = b"Bearer " + key.encode("utf-8")
    return hmac.compare_digest(_digest(authorization or b""), _digest(expected))


def header_bytes(scope: dict) -> int:
    """Bytes of the request line and headers as sent (the server strips only whitespace around values)."""
    target = len(scope.get("raw_path") or scope["path"].encode()) + \
        (1 + len(scope["query_string"]) if scope.get("query_string") else 0)
    request_line = len(scope["method"]) + 1 + target + len(" HTTP/1.1\r\n")
    return request_line + sum(len(name) + len(value) + 4 for name, value in scope.get("headers") or []) + 2


def headers_too_large(limit: int, size: int | None = None) -> str:
    """The 431 message, for the guard and for the HTTP protocol (which knows no exact size)."""
    measured = f"are {size} bytes, over" if size is not None else "are over"
    return (f"the request line and headers {measured} the server's limit of {limit} bytes "
            "(--h11-max-incomplete-event-size); send shorter headers, or raise the limit")


async def refuse(send: Any, status: int, message: str, extra_headers: list | None = None) -> None:
    """Answers `status` with the OpenAI error body and closes the connection."""
    body = json.dumps(error_body(message, status)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
               (b"connection", b"close")] + (extra_headers or [])
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


class _BodyRefused(Exception):
    def __init__(self, status: int, message: str):
        self.status, self.message = status, message


class RequestGuard:
    """Reads its limits from `state.config` on every request, so they can be changed while serving."""

    def __init__(self, app: Any, state: Any):
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        cfg = self.state.config
        size = header_bytes(scope)
        if size > cfg.h11_max_incomplete_event_size:
            await refuse(send, 431, headers_too_large(cfg.h11_max_incomplete_event_size, size))
            return
        headers = dict(scope.get("headers") or [])
        if cfg.api_key and not self._open_route(scope["path"], cfg) \
                and not key_matches(headers.get(b"authorization"), cfg.api_key):
            await refuse(send, 401, "missing or wrong API key; send `Authorization: Bearer <key>`",
                          [(b"www-authenticate", b"Bearer")])
            return
        limit = cfg.max_request_body_bytes
        declared = headers.get(b"content-length", b"0")
        if not declared.isdigit():
            await refuse(send, 400, "the Content-Length header is not a number")
            return
        if int(declared) > limit:
            await refuse(send, 413, f"the request body is larger than the server's limit of {limit} bytes "
                                     "(--max-request-body-bytes)")
            return
        try:
            body = await self._read_body(receive, limit, cfg.request_body_timeout)
        except _BodyRefused as exc:
            await refuse(send, exc.status, exc.message)
            return
        if body is None:  # the client left while sending
            return
        await self.app(scope, self._replay(body, receive), send)

    @staticmethod
    def _open_route(path: str, cfg: Any) -> bool:
        return path in OPEN_ROUTES or (path == "/metrics" and cfg.metrics_without_auth)

    @staticmethod
    async def _read_body(receive: Any, limit: int, timeout: float) -> bytes | None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        chunks, size, more = [], 0, True
        while more:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                raise _BodyRefused(408, f"the request body did not arrive within {timeout:g} s "
                                        "(--request-body-timeout)") from None
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise _BodyRefused(413, f"the request body is larger than the server's limit of {limit} bytes "
                                        "(--max-request-body-bytes)")
            chunks.append(chunk)
            more = message.get("more_body", False)
        return b"".join(chunks)

    @staticmethod
    def _replay(body: bytes, receive: Any):
        delivered = False

        async def replay():
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return replay
