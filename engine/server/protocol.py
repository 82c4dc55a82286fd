"""Request bodies of the OpenAI API as pydantic models, and OpenAI-style error bodies.

Unknown fields are ignored (clients send many); fields we do not implement are refused with a
400 that names them, rather than silently changing the meaning of a request.
"""
from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Sampling(BaseModel):
    """Sampling fields shared by /v1/completions and /v1/chat/completions (vLLM extras included)."""

    model_config = ConfigDict(extra="ignore")
    model: Optional[str] = None
    n: int = Field(default=1, ge=1, le=128)
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    seed: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    presence_penalty: Optional[float] = 0.0
    frequency_penalty: Optional[float] = 0.0
    repetition_penalty: Optional[float] = 1.0
    logit_bias: Optional[dict[str, float]] = None
    user: Optional[str] = None
    response_format: Optional[dict[str, Any]] = None
    guided_json: Optional[Union[str, dict[str, Any]]] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None
    request_id: Optional[str] = None
    return_tokens_as_token_ids: bool = False  # vLLM: logprob tokens as "token_id:N"

    def unsupported(self) -> list[str]:
        """Fields set to values this server does not implement."""
        bad = []
        if self.presence_penalty not in (None, 0, 0.0):
            bad.append("presence_penalty")
        if self.frequency_penalty not in (None, 0, 0.0):
            bad.append("frequency_penalty")
        if self.repetition_penalty not in (None, 1, 1.0):
            bad.append("repetition_penalty")
        if self.logit_bias:
            bad.append("logit_bias")
        return bad


class CompletionRequest(_Sampling):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: Optional[int] = 16
    echo: bool = False
    logprobs: Optional[int] = Field(default=None, ge=0, le=20)
    prompt_logprobs: Optional[int] = Field(default=None, ge=0, le=20)
    best_of: Optional[int] = None
    suffix: Optional[str] = None
    add_special_tokens: bool = True


class ChatCompletionRequest(_Sampling):
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_tokens: Optional[int] = None
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(default=None, ge=0, le=20)
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[Union[Literal["none", "auto", "required"], dict[str, Any]]] = None
    parallel_tool_calls: Optional[bool] = True
    add_generation_prompt: bool = True
    chat_template_kwargs: Optional[dict[str, Any]] = None
    reasoning_effort: Optional[str] = None


def error_body(message: str, status: int, err_type: str | None = None, param: str | None = None) -> dict:
    kinds = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
             422: "BadRequestError", 500: "InternalServerError", 503: "ServiceUnavailableError"}
    return {"error": {"message": message, "type": err_type or kinds.get(status, "BadRequestError"),
                      "param": param, "code": status}}
