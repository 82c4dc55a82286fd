"""The FastAPI app: routes, OpenAI-style errors, and the server's shared state.

    state = ServerState.create(ServeConfig(model="embedded:smollm2-135m-instruct"))
    app = build_app(state)          # serve with launch.py; state.close() stops the engine thread

Routes: GET /health, /ping, /version, /v1/models, /metrics; POST /v1/completions,
/v1/chat/completions, /tokenize, /detokenize, /tokenizer_info. Every error body is
`{"error": {"message", "type", "param", "code"}}`; the guard in http_guard.py (API key, body size
and deadline) runs before any route.
"""
from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from onecat.engine.server import cpu_work
from onecat.engine.server.chat import create_chat_completion
from onecat.engine.server.chat_prompt import render_prompt, tool_dicts
from onecat.engine.server.completions import create_completion
from onecat.engine.server.errors import ApiError, ClientDisconnected, error_body
from onecat.engine.server.http_guard import RequestGuard
from onecat.engine.server.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                           TokenizeChatRequest, TokenizeCompletionRequest)
from onecat.engine.server.request_body import parse_json, parse_request, validate_as, validation_message
from onecat.engine.server.serve_config import ServeConfig  # noqa: F401  (importable from here)
from onecat.engine.server.state import ServerState

log = logging.getLogger("onecat.server")
VERSION = "0.1.0"


def _error(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, status, param=param), status_code=status)


def _parse_tokenize(raw: bytes) -> TokenizeChatRequest | TokenizeCompletionRequest:
    data = parse_json(raw)
    shape = TokenizeChatRequest if isinstance(data, dict) and "messages" in data else TokenizeCompletionRequest
    return validate_as(data, shape)


def _token_ids(state: ServerState, req: TokenizeChatRequest | TokenizeCompletionRequest) -> list[int]:
    """/tokenize's work, on a worker thread: a plain prompt, or chat messages through the chat template."""
    tok = state.tokenizer
    if isinstance(req, TokenizeChatRequest):
        tools = tool_dicts(req.tools)
        prompt = render_prompt(tok, req.messages, tools, add_generation_prompt=req.add_generation_prompt,
                               template_kwargs=req.chat_template_kwargs)
        return cpu_work.encode(tok, prompt, add_special_tokens=False)
    return cpu_work.encode(tok, req.prompt, add_special_tokens=req.add_special_tokens)


def build_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="onecat OpenAI-compatible server", version=VERSION)
    app.state.onecat = state
    app.add_middleware(RequestGuard, state=state)

    @app.exception_handler(ApiError)
    async def api_error(_: Request, exc: ApiError):
        return _error(exc.status, exc.message, exc.param)

    @app.exception_handler(ClientDisconnected)
    async def disconnected(_: Request, exc: ClientDisconnected):
        return Response(status_code=499)  # nobody reads it; nginx's "client closed request"

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError):
        msg, param = validation_message(exc.errors())
        return _error(400, msg, param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException):
        return _error(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def internal_error(_: Request, exc: Exception):
        log.exception("request failed")
        return _error(500, f"internal error: {type(exc).__name__}: {exc}")

    @app.get("/health")
    async def health():
        reason = state.engine.down_reason()
        if reason is not None:  # a supervisor watching /health restarts the server
            return _error(503, f"{reason}; restart the server")
        return Response(status_code=200)

    @app.get("/ping")
    async def ping():
        return await health()

    @app.get("/version")
    async def version():
        return {"version": VERSION}

    @app.get("/v1/models")
    async def models():
        data = [{"id": name, "object": "model", "created": state.created, "owned_by": "onecat",
                 "root": state.config.model, "parent": None, "max_model_len": state.max_model_len}
                for name in state.model_names]
        return {"object": "list", "data": data}

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def respond(result: Any):
        if isinstance(result, dict):
            return JSONResponse(result)
        return StreamingResponse(result, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = await state.cpu.run(parse_request, await request.body(), CompletionRequest)
        return await respond(await create_completion(state, req, request))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = await state.cpu.run(parse_request, await request.body(), ChatCompletionRequest)
        return await respond(await create_chat_completion(state, req, request))

    @app.post("/tokenize")
    async def tokenize(request: Request):
        req = await state.cpu.run(_parse_tokenize, await request.body())
        state.resolve_model_name(req.model)
        ids = await state.cpu.run(_token_ids, state, req)
        body = {"tokens": ids, "count": len(ids), "max_model_len": state.max_model_len}
        return await state.cpu.run(JSONResponse, body)  # rendering a long id list is CPU work too

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        """What a remote tokenizer client needs (lm-eval's RemoteTokenizer reads eos/bos/pad and the chat
        template here, then tokenizes through /tokenize): special tokens as text, the chat template,
        the context length."""
        tok = state.tokenizer

        def text(tid: int | None) -> str | None:
            return None if tid is None else tok.decode([tid], skip_special_tokens=False)

        return {"tokenizer_class": "onecat", "eos_token": text(tok.eos_token_ids[0] if tok.eos_token_ids else None),
                "eos_token_ids": tok.eos_token_ids, "bos_token": text(tok.bos_token_id),
                "bos_token_id": tok.bos_token_id, "add_bos_token": tok.add_bos, "pad_token": None,
                "chat_template": tok.chat_template, "model_max_length": state.max_model_len,
                "vocab_size": state.vocab_size}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        req = await state.cpu.run(parse_request, await request.body(), DetokenizeRequest)
        state.resolve_model_name(req.model)
        outside = [t for t in req.tokens if t >= state.vocab_size]
        if outside:
            raise ApiError(400, f"token ids {outside[:5]} are outside the vocabulary [0, {state.vocab_size})",
                           param="tokens")
        text = await state.cpu.run(cpu_work.decode, state.tokenizer, req.tokens)
        return {"prompt": text}

    return app
