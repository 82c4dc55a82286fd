"""The FastAPI app: routes, API-key check, OpenAI-style errors, and the server's shared state.

    state = ServerState.create(ServeConfig(model="embedded:smollm2-135m-instruct"))
    app = build_app(state)          # serve with uvicorn; state.close() stops the engine thread

Routes: GET /health, /ping, /version, /v1/models, /metrics; POST /v1/completions,
/v1/chat/completions, /tokenize, /detokenize. Every error body is
`{"error": {"message", "type", "param", "code"}}`.
"""
from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from onecat.engine.server.async_engine import AsyncEngine
from onecat.engine.server.metrics import ServerMetrics
from onecat.engine.server.protocol import ChatCompletionRequest, CompletionRequest, error_body
from onecat.engine.server.serving import ApiError, ClientDisconnected, create_chat_completion, create_completion

log = logging.getLogger("onecat.server")
VERSION = "0.1.0"


@dataclass
class ServeConfig:
    """`onecat serve` settings; names follow `vllm serve`."""

    model: str
    served_model_name: list[str] = field(default_factory=list)
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: Optional[str] = None
    max_model_len: Optional[int] = None
    kv_cache_dtype: str = "auto"
    quantization: Optional[str] = None
    enable_prefix_caching: bool = True
    speculative_config: Optional[dict] = None
    tensor_parallel_size: int = 1
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    dtype: str = "auto"
    seed: int = 0
    device: str = "auto"
    max_queue_len: int = 1024
    reasoning_parser: str = "think"  # "think": split <think>...</think> into reasoning_content; "none"
    llm_kwargs: dict = field(default_factory=dict)  # extra LLM(...) arguments (e.g. num_kv_blocks)

    def llm_args(self) -> dict:
        if self.tensor_parallel_size != 1:
            raise ValueError(f"--tensor-parallel-size {self.tensor_parallel_size}: onecat serve runs one "
                             "device per server; use --tensor-parallel-size 1")
        kw = dict(model=self.model, dtype=self.dtype, kv_cache_dtype=self.kv_cache_dtype,
                  max_model_len=self.max_model_len, max_num_seqs=self.max_num_seqs,
                  max_num_batched_tokens=self.max_num_batched_tokens,
                  enable_prefix_caching=self.enable_prefix_caching, seed=self.seed, device=self.device,
                  speculative_config=self.speculative_config, quantization=self.quantization)
        kw.update(self.llm_kwargs)
        return kw


class ServerState:
    """What handlers share: the engine thread, the tokenizer, names, metrics, guided decoding."""

    def __init__(self, llm: Any, config: ServeConfig):
        self.llm = llm
        self.config = config
        self.tokenizer = llm.tokenizer
        self.max_model_len = llm.max_model_len
        self.model_names = config.served_model_name or [config.model]
        self.reasoning_parser = config.reasoning_parser
        self.created = int(time.time())
        self.metrics = ServerMetrics(self.model_names[0], lambda: getattr(self.llm, "engine", None))
        self.engine = AsyncEngine(llm, max_queue_len=config.max_queue_len, metrics=self.metrics)
        self._guided = None
        self._guided_lock = threading.Lock()

    @classmethod
    def create(cls, config: ServeConfig) -> "ServerState":
        from onecat.engine import LLM

        return cls(LLM(**config.llm_args()), config)

    def resolve_model_name(self, name: str | None) -> str:
        if name is None or name in self.model_names:
            return name or self.model_names[0]
        raise ApiError(404, f"The model `{name}` does not exist. Served models: {', '.join(self.model_names)}",
                       param="model")

    def guided(self):
        from onecat.engine.server.guided import GuidedDecoding

        with self._guided_lock:
            if self._guided is None:
                self._guided = GuidedDecoding(self.tokenizer, self.llm.model_config.vocab_size)
            return self._guided

    def grammar_for(self, req: Any, schema_override: Any = None) -> str | None:
        from onecat.engine.server.guided import GuidedDecoding

        if schema_override is None and not (req.response_format and req.response_format.get("type") != "text") \
                and req.guided_json is None and req.guided_regex is None and req.guided_choice is None \
                and req.guided_grammar is None:
            return None
        self.guided()
        if schema_override is not None:
            return GuidedDecoding.grammar_for(json_schema=schema_override)
        return GuidedDecoding.grammar_for(req.response_format, json_schema=req.guided_json,
                                          regex=req.guided_regex, choice=req.guided_choice, lark=req.guided_grammar)

    def close(self) -> None:
        self.engine.shutdown()


def _error(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, status, param=param), status_code=status)


def _validation_message(errors: list) -> tuple[str, str | None]:
    parts, param = [], None
    for e in errors[:5]:
        loc = [str(x) for x in e.get("loc", ()) if x != "body"]
        if e.get("type") == "json_invalid":
            return f"the request body is not valid JSON: {e.get('msg')}", None
        param = param or (loc[0] if loc else None)
        parts.append(f"{'.'.join(loc) or 'body'}: {e.get('msg')}")
    return "invalid request: " + "; ".join(parts), param


async def _parse(request: Request, model: type) -> Any:
    raw = await request.body()
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        msg, param = _validation_message(exc.errors())
        raise ApiError(400, msg, param=param) from None


class _ApiKeyMiddleware:
    """Plain ASGI (not BaseHTTPMiddleware, which hides client disconnects from handlers)."""

    def __init__(self, app: Any, state: ServerState):
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send):
        key = self.state.config.api_key
        if key and scope["type"] == "http" and scope["path"].startswith("/v1"):
            headers = dict(scope.get("headers") or [])
            if headers.get(b"authorization", b"").decode("latin-1") != f"Bearer {key}":
                await _error(401, "missing or wrong API key; send `Authorization: Bearer <key>`")(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="onecat OpenAI-compatible server", version=VERSION)
    app.state.onecat = state

    app.add_middleware(_ApiKeyMiddleware, state=state)

    @app.exception_handler(ApiError)
    async def api_error(_: Request, exc: ApiError):
        return _error(exc.status, exc.message, exc.param)

    @app.exception_handler(ClientDisconnected)
    async def disconnected(_: Request, exc: ClientDisconnected):
        return Response(status_code=499)  # nobody reads it; nginx's "client closed request"

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError):
        msg, param = _validation_message(exc.errors())
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
        if not state.engine.alive:
            return _error(503, "the engine thread has stopped")
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
        req = await _parse(request, CompletionRequest)
        return await respond(await create_completion(state, req, request))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = await _parse(request, ChatCompletionRequest)
        return await respond(await create_chat_completion(state, req, request))

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = await request.json()
        if "messages" in body:
            prompt = state.tokenizer.apply_chat_template(body["messages"], add_generation_prompt=True)
            ids = state.tokenizer.encode(prompt, add_special_tokens=False)
        else:
            ids = state.tokenizer.encode(str(body.get("prompt", "")),
                                         add_special_tokens=bool(body.get("add_special_tokens", True)))
        return {"tokens": ids, "count": len(ids), "max_model_len": state.max_model_len}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        body = await request.json()
        return {"prompt": state.tokenizer.decode(list(body.get("tokens", [])))}

    return app
