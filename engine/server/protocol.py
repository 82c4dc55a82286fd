"""Request bodies of the OpenAI API (and vLLM's extras) as pydantic models.

Unknown fields are ignored (clients send many); fields we do not implement are refused with a
400 that names them, rather than silently changing the meaning of a request. Every field has the
type and range the code behind it relies on, so a malformed value is a 400 here and never an
exception further in: numbers are finite, token ids and counts non-negative, nested objects
(messages, tool calls, tools, response_format) have the shape the chat template and the grammar
compiler read. The sampling settings take their bounds from SamplingParams (engine/sampling_params.py),
narrowed where the API allows less; sampling_body.py turns a body into SamplingParams.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, PlainValidator

from onecat.engine.sampling_params import setting

TokenId = Annotated[int, Field(ge=0)]


def _token_ids(value: Any) -> list[int]:
    """A list of non-negative ints, checked in C: a prompt may hold hundreds of thousands of ids,
    and element-wise validation of that many is slow."""
    if not isinstance(value, list) or not set(map(type, value)) <= {int}:
        raise ValueError("must be a list of integer token ids")
    if value and min(value) < 0:
        raise ValueError(f"token ids must be >= 0, got {min(value)}")
    return value


def _prompt(value: Any) -> Any:
    """`prompt`: a string, a list of strings, token ids, or lists of token ids; dispatched by shape
    (a union would try every member on every element)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        kinds = set(map(type, value))
        if kinds <= {str}:
            return value
        if kinds <= {int}:
            return _token_ids(value)
        if kinds <= {list}:
            return [_token_ids(item) for item in value]
    raise ValueError("prompt must be a string, a list of strings, a list of token ids or a list of lists of token ids")


TokenIds = Annotated[list[int], PlainValidator(_token_ids)]
Prompt = Annotated[Union[str, list[str], list[int], list[list[int]]], PlainValidator(_prompt)]
MAX_LOGPROBS = 20
# Streaming holds back any tail that may still become a stop string, checked on every engine step:
# bounded so that check stays cheap whatever a client sends.
MAX_STOP_STRINGS, MAX_STOP_LEN = 32, 512
StopString = Annotated[str, Field(max_length=MAX_STOP_LEN)]


def _setting(name: str, default: Any = None, **narrower: float) -> Any:
    """A body field carrying SamplingParams' setting `name`, with its bounds and help (narrower ones where the API
    allows less); None, unset, leaves the engine's default."""
    declared = setting(name)
    return Field(default=default, description=declared.help, **{**declared.bounds.constraints(), **narrower})


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class _Open(BaseModel):
    """Objects whose extra fields travel on (into the chat template, into tool specs)."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False


# --------------------------------------------------------------------------- chat messages and tools
class FunctionCall(_Open):
    name: str
    arguments: Union[str, dict[str, Any]] = "{}"


class ToolCall(_Open):
    id: Optional[str] = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Open):
    role: Literal["system", "user", "assistant", "tool", "developer", "function"]
    content: Optional[Union[str, list[Any]]] = None  # text parts are checked where they are joined
    name: Optional[str] = None
    tool_calls: Optional[list[ToolCall]] = None
    tool_call_id: Optional[str] = None


class FunctionSpec(_Open):
    name: str
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None


class ToolSpec(_Open):
    type: Literal["function"] = "function"
    function: FunctionSpec


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"] = "function"
    function: NamedFunction


class JsonSchemaSpec(_Open):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False, populate_by_name=True)
    name: Optional[str] = None
    description: Optional[str] = None
    schema_: Optional[dict[str, Any]] = Field(default=None, alias="schema")
    strict: Optional[bool] = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaSpec] = None

    def as_dict(self) -> dict:
        """The shape guided.GuidedDecoding.grammar_for reads."""
        return self.model_dump(by_alias=True, exclude_none=True)


# --------------------------------------------------------------------------- completions
class _Sampling(_Body):
    """Sampling fields shared by /v1/completions and /v1/chat/completions (vLLM extras included)."""

    model: Optional[str] = None
    n: int = Field(default=1, ge=1, le=128)
    temperature: Optional[float] = _setting("temperature")
    top_p: Optional[float] = _setting("top_p")
    top_k: Optional[int] = _setting("top_k")
    min_p: Optional[float] = _setting("min_p")
    seed: Optional[int] = _setting("seed")
    stop: Optional[Union[StopString, list[StopString]]] = Field(default=None, max_length=MAX_STOP_STRINGS)
    stop_token_ids: Optional[TokenIds] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    ignore_eos: bool = False
    min_tokens: int = _setting("min_tokens", default=0)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    presence_penalty: Optional[float] = 0.0
    frequency_penalty: Optional[float] = 0.0
    repetition_penalty: Optional[float] = 1.0
    logit_bias: Optional[dict[str, float]] = None
    user: Optional[str] = None
    response_format: Optional[ResponseFormat] = None
    guided_json: Optional[Union[str, dict[str, Any]]] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = Field(default=None, min_length=1)
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

    def constrained(self) -> bool:
        """Whether a grammar constrains the output."""
        return bool(self.response_format and self.response_format.type != "text") or any(
            v is not None for v in (self.guided_json, self.guided_regex, self.guided_choice, self.guided_grammar))


class CompletionRequest(_Sampling):
    prompt: Prompt
    max_tokens: Optional[int] = _setting("max_tokens", default=16)
    echo: bool = False
    logprobs: Optional[int] = _setting("logprobs", le=MAX_LOGPROBS)
    prompt_logprobs: Optional[int] = _setting("prompt_logprobs", le=MAX_LOGPROBS)
    best_of: Optional[int] = None
    suffix: Optional[str] = None
    add_special_tokens: bool = True


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[int] = _setting("max_tokens")
    max_completion_tokens: Optional[int] = _setting("max_tokens")
    logprobs: bool = False
    top_logprobs: Optional[int] = _setting("logprobs", le=MAX_LOGPROBS)
    tools: Optional[list[ToolSpec]] = None
    tool_choice: Optional[Union[Literal["none", "auto", "required"], NamedToolChoice]] = None
    parallel_tool_calls: Optional[bool] = True
    add_generation_prompt: bool = True
    chat_template_kwargs: Optional[dict[str, Any]] = None
    reasoning_effort: Optional[str] = None


# --------------------------------------------------------------------------- /tokenize, /detokenize
class TokenizeCompletionRequest(_Body):
    model: Optional[str] = None
    prompt: str
    add_special_tokens: bool = True


class TokenizeChatRequest(_Body):
    model: Optional[str] = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    tools: Optional[list[ToolSpec]] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None


class DetokenizeRequest(_Body):
    model: Optional[str] = None
    tokens: TokenIds
