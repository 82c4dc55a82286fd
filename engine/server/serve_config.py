"""`onecat serve` settings: the engine's (one EngineArgs) and the server's own, each declared once.

Names follow `vllm serve` (and uvicorn, for the HTTP limits); cli/serve.py generates its flags from
these fields. Engine settings may also be given flat:

    ServeConfig(model="embedded:smollm2-135m-instruct", max_model_len=1024, api_key="k")
    # == ServeConfig(engine=EngineArgs(model=..., max_model_len=1024), api_key="k")
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Optional

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from onecat.engine.args import EngineArgs


def _think_parser(name: str) -> str:
    """qwen3 and deepseek_r1 (vLLM's parser names) both mean the <think>...</think> parser."""
    return "think" if name in ("qwen3", "deepseek_r1") else name


def _zero_is_no_limit(value: Any) -> Any:
    return None if value == 0 else value


class ServeConfig(BaseModel):
    """The server's config. Mutable: tests change a limit on a running server's config."""

    model_config = ConfigDict(extra="forbid")

    engine: EngineArgs
    served_model_name: list[str] = Field(default_factory=list, description="name(s) clients use; default: MODEL")
    host: str = Field(default="127.0.0.1", description="address to listen on")
    port: int = Field(default=8000, ge=0, le=65535, description="port to listen on")
    api_key: Optional[str] = Field(default=None, json_schema_extra={"envvar": "ONECAT_API_KEY"},
                                   description="require `Authorization: Bearer KEY` on every route but /health "
                                               "and /ping")
    metrics_without_auth: bool = Field(default=False, description="serve /metrics without the API key")
    max_queue_len: int = Field(default=1024, ge=0,
                               description="requests allowed to wait beyond --max-num-seqs; more get 503")
    reasoning_parser: Annotated[Literal["think", "qwen3", "deepseek_r1", "none"], AfterValidator(_think_parser)] = \
        Field(default="think", description="think (= qwen3, deepseek_r1): <think>...</think> -> reasoning_content; "
                                           "none: off")
    max_request_body_bytes: int = Field(default=16 * 2**20, gt=0, description="larger request bodies get 413")
    request_header_timeout: float = Field(default=10.0, gt=0,
                                          description="seconds for a request line and headers to arrive (from "
                                                      "connect or the last response); slower connections are closed")
    request_body_timeout: float = Field(default=60.0, gt=0,
                                        description="seconds for a whole request body to arrive; else 408")
    timeout_keep_alive: float = Field(default=5.0, gt=0,
                                      description="close idle keep-alive connections after this many seconds")
    limit_concurrency: Annotated[Optional[int], BeforeValidator(_zero_is_no_limit)] = Field(
        default=2048, ge=1, description="open connections + requests in progress beyond which new requests get "
                                        "503; 0: no limit")
    h11_max_incomplete_event_size: int = Field(default=16 * 1024, gt=0,
                                               description="bytes of request line + headers; more get 431")
    cpu_workers: int = Field(default=2, ge=1, description="threads for tokenizing, templating, grammar compiling")
    burst_gap_ms: float = Field(default=2.0, ge=0, le=100,
                                description="an idle engine woken by a request keeps taking the requests that "
                                            "arrive within this many ms of the one before (until max_num_seqs "
                                            "wait) before its first step, so a burst prefills in one step, not "
                                            "its first request alone and the rest behind it; 0: step at once")

    @model_validator(mode="before")
    @classmethod
    def _flat_engine_settings(cls, data: Any) -> Any:
        """EngineArgs names given next to the server's own settings (or in `llm_kwargs`) go into `engine`."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        engine = data.pop("engine", None)
        engine = engine.model_dump(exclude_defaults=True) if isinstance(engine, EngineArgs) else dict(engine or {})
        engine.update(data.pop("llm_kwargs", None) or {})
        engine.update({k: data.pop(k) for k in list(data) if k in EngineArgs.model_fields})
        return {**data, "engine": engine}

    @property
    def model(self) -> str:
        return self.engine.model
