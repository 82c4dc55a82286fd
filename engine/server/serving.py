"""/v1/completions and /v1/chat/completions: requests -> engine requests -> OpenAI responses.

One HTTP request becomes `n` engine requests per prompt (the engine samples one sequence per
request; choice j gets seed + j when a seed is given). Streaming answers are Server-Sent Events
whose deltas never take text back (see streaming.py). A client that goes away aborts every engine
request of its call, which frees their KV blocks.
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from onecat.engine.sampling_params import InvalidRequestError, SamplingParams
from onecat.engine.server.async_engine import EngineRequestError
from onecat.engine.server.guided import GrammarError
from onecat.engine.server.parsers import (TOOL_OPEN, THINK_CLOSE, THINK_OPEN, content_before_tools, make_tool_call,
                                          parse_tool_calls, split_reasoning, tools_system_prompt)
from onecat.engine.server.protocol import ChatCompletionRequest, CompletionRequest
from onecat.engine.server.streaming import holdback_len


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


# --------------------------------------------------------------------------- shared helpers
def _check_common(state: Any, req: Any) -> str:
    model = state.resolve_model_name(req.model)
    bad = req.unsupported()
    if bad:
        raise ApiError(400, f"{', '.join(bad)} is not supported by this server; leave it at its default",
                       param=bad[0])
    return model


def _sampling_params(req: Any, max_tokens: int | None, choice: int, *, logprobs: int | None,
                     prompt_logprobs: int | None, processors: list | None) -> SamplingParams:
    seed = req.seed + choice if req.seed is not None else None
    kw: dict[str, Any] = dict(
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p, top_k=req.top_k or 0,
        min_p=req.min_p or 0.0, seed=seed, max_tokens=max_tokens, min_tokens=req.min_tokens,
        stop=req.stop, stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos,
        include_stop_str_in_output=req.include_stop_str_in_output, logprobs=logprobs,
        prompt_logprobs=prompt_logprobs, skip_special_tokens=req.skip_special_tokens)
    if processors:
        kw["extra"] = {"logits_processors": processors}
    try:
        return SamplingParams(**kw)
    except InvalidRequestError as exc:
        raise ApiError(400, str(exc)) from None


def _max_tokens(state: Any, requested: int | None, prompt_len: int) -> int | None:
    limit = state.max_model_len
    if prompt_len >= limit:
        raise ApiError(400, f"This model's maximum context length is {limit} tokens. However, your prompt has "
                            f"{prompt_len} tokens; shorten the prompt", param="messages")
    if requested is None:
        return limit - prompt_len
    if requested < 0:
        raise ApiError(400, f"max_tokens={requested} must be >= 0", param="max_tokens")
    if prompt_len + requested > limit:
        raise ApiError(400, f"This model's maximum context length is {limit} tokens. However, you requested "
                            f"{prompt_len + requested} tokens ({prompt_len} in the prompt, {requested} for the "
                            "completion). Reduce the prompt or max_tokens.", param="max_tokens")
    return requested


def _grammar_processor(state: Any, req: Any, *, schema_override: Any = None):
    """A fresh logits processor for one engine request, or None when unconstrained."""
    try:
        grammar = state.grammar_for(req, schema_override)
    except GrammarError as exc:
        raise ApiError(400, str(exc), param="response_format") from None
    if grammar is None:
        return None
    try:
        return state.guided().processor(grammar)
    except GrammarError as exc:
        raise ApiError(400, str(exc), param="response_format") from None


class ClientDisconnected(Exception):
    """The client went away before its answer was ready; its engine requests were aborted."""


@dataclass
class _Job:
    """The engine requests of one HTTP call and the queue their outputs arrive on."""

    state: Any
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    ids: list[str] = field(default_factory=list)
    finished: set = field(default_factory=set)

    async def add(self, rid: str, prompt_ids: list[int], params: SamplingParams) -> None:
        from onecat.engine.server.async_engine import QueueFullError, RequestRejected

        try:
            await self.state.engine.submit(rid, prompt_ids, params, add_special_tokens=False,
                                           out_queue=self.queue)
        except QueueFullError as exc:
            raise ApiError(503, str(exc)) from None
        except RequestRejected as exc:
            raise ApiError(400, str(exc)) from None
        self.ids.append(rid)

    def abort_unfinished(self) -> None:
        for rid in self.ids:
            if rid not in self.finished:
                self.state.engine.abort(rid)

    async def outputs(self, request: Any = None) -> AsyncIterator[tuple[str, Any]]:
        """(request id, RequestOutput) as they come, until every request finished."""
        last_check = time.monotonic()
        while len(self.finished) < len(self.ids):
            if request is None:
                rid, out = await self.queue.get()
            else:
                try:
                    rid, out = await asyncio.wait_for(self.queue.get(), timeout=0.5)
                except asyncio.TimeoutError:
                    rid, out = None, None
                if time.monotonic() - last_check >= 0.5 or out is None:
                    last_check = time.monotonic()
                    if await request.is_disconnected():
                        self.abort_unfinished()
                        raise ClientDisconnected()
                if out is None:
                    continue
            if isinstance(out, EngineRequestError):
                self.finished.add(rid)
                self.abort_unfinished()
                raise ApiError(500, str(out))
            if out.finished:
                self.finished.add(rid)
            yield rid, out


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _token_str(tok: Any, tid: int, as_ids: bool = False) -> str:
    return f"token_id:{tid}" if as_ids else tok.decode([tid], skip_special_tokens=False)


def _usage(prompt_tokens: int, completion_tokens: int, cached: int = 0) -> dict:
    u = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
         "total_tokens": prompt_tokens + completion_tokens}
    if cached:
        u["prompt_tokens_details"] = {"cached_tokens": cached}
    return u


# --------------------------------------------------------------------------- /v1/completions
def _completion_logprobs(tok: Any, out: Any, echo: bool, start: int, end: int, offset0: int,
                         top_n: int, as_ids: bool = False) -> dict:
    tokens, token_lps, tops, offsets = [], [], [], []
    pos = offset0
    if echo:
        plp = out.prompt_logprobs or [None] * len(out.prompt_token_ids)
        for i, tid in enumerate(out.prompt_token_ids):
            s = _token_str(tok, tid, as_ids)
            lp = plp[i] if i < len(plp) else None
            tokens.append(s)
            token_lps.append(lp)
            tops.append(None if lp is None else {s: lp})
            offsets.append(pos)
            pos += len(tok.decode([tid], skip_special_tokens=False)) if as_ids else len(s)
    for k in range(start, end):
        tid = out.token_ids[k]
        s = _token_str(tok, tid, as_ids)
        d = (out.logprobs[k] if out.logprobs and k < len(out.logprobs) else {}) or {}
        tokens.append(s)
        token_lps.append(d.get(tid))
        ranked = sorted(d.items(), key=lambda kv: -kv[1])
        top = {}
        for t, v in ranked[:max(top_n, 1)]:
            top.setdefault(_token_str(tok, t, as_ids), v)
        if s not in top and tid in d:
            top[s] = d[tid]
        tops.append(top)
        offsets.append(pos)
        pos += len(tok.decode([tid], skip_special_tokens=False)) if as_ids else len(s)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def _prompts_of(state: Any, req: CompletionRequest) -> list[tuple[str | None, list[int]]]:
    p = req.prompt
    if isinstance(p, str):
        items: list = [p]
    elif p and all(isinstance(x, int) for x in p):
        items = [p]
    else:
        items = list(p)
    if not items:
        raise ApiError(400, "prompt is empty; give a string, a list of strings or token ids", param="prompt")
    out = []
    for item in items:
        if isinstance(item, str):
            ids = state.tokenizer.encode(item, add_special_tokens=req.add_special_tokens)
            out.append((item, ids))
        else:
            out.append((None, list(item)))
        if not out[-1][1]:
            raise ApiError(400, "a prompt has no tokens; give at least one", param="prompt")
    return out


async def _collect_finals(job, request) -> dict[str, Any]:
    """Wait for every request of a non-streaming call; abort the rest if the client goes away."""
    finals: dict[str, Any] = {}
    try:
        async for rid, out in job.outputs(request):
            if out.finished:
                finals[rid] = out
    except BaseException:
        job.abort_unfinished()
        raise
    return finals


async def create_completion(state: Any, req: CompletionRequest, request: Any):
    model = _check_common(state, req)
    if req.suffix:
        raise ApiError(400, "suffix is not supported", param="suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise ApiError(400, "best_of other than n is not supported", param="best_of")
    prompts = _prompts_of(state, req)
    if req.max_tokens == 0 and not req.echo:
        raise ApiError(400, "max_tokens=0 generates nothing; use echo=true with logprobs to score a prompt",
                       param="max_tokens")
    want_prompt_lps = req.prompt_logprobs if req.prompt_logprobs is not None else (
        0 if req.echo and req.logprobs is not None or req.max_tokens == 0 else None)
    base = req.request_id or f"cmpl-{uuid.uuid4().hex}"
    job = _Job(state)
    choice_of: dict[str, tuple[int, int]] = {}
    try:
        for i, (text, ids) in enumerate(prompts):
            mt = _max_tokens(state, req.max_tokens, len(ids))
            for j in range(req.n):
                params = _sampling_params(req, mt, j, logprobs=req.logprobs, prompt_logprobs=want_prompt_lps,
                                          processors=[p] if (p := _grammar_processor(state, req)) else None)
                rid = f"{base}-{i}-{j}"
                choice_of[rid] = (i, i * req.n + j)
                await job.add(rid, ids, params)
    except BaseException:
        job.abort_unfinished()
        raise
    created = int(time.time())
    tok = state.tokenizer
    prompt_texts = [t if t is not None else tok.decode(ids, skip_special_tokens=False) for t, ids in prompts]
    if req.stream:
        n_prompt = sum(len(ids) for _, ids in prompts)
        return _stream_completion(state, req, job, base, model, created, choice_of, prompt_texts, n_prompt)
    finals = await _collect_finals(job, request)
    choices = []
    for rid in job.ids:
        i, index = choice_of[rid]
        out = finals[rid]
        text = (prompt_texts[i] if req.echo else "") + out.text
        lps = None
        if req.logprobs is not None:
            lps = _completion_logprobs(tok, out, req.echo, 0, len(out.token_ids), 0, req.logprobs,
                                       req.return_tokens_as_token_ids)
        choice = {"index": index, "text": text, "logprobs": lps, "finish_reason": out.finish_reason,
                  "stop_reason": out.stop_reason}
        if req.prompt_logprobs is not None:
            choice["prompt_logprobs"] = out.prompt_logprobs
        choices.append(choice)
    choices.sort(key=lambda c: c["index"])
    n_prompt = sum(len(ids) for _, ids in prompts)
    n_out = sum(len(o.token_ids) for o in finals.values())
    cached = sum(o.num_cached_tokens for o in finals.values())
    return {"id": base, "object": "text_completion", "created": created, "model": model, "choices": choices,
            "usage": _usage(n_prompt, n_out, cached)}


async def _stream_completion(state, req, job: _Job, base, model, created, choice_of, prompt_texts, n_prompt):
    tok = state.tokenizer
    markers = list(req.stop if isinstance(req.stop, list) else [req.stop] if req.stop else [])
    sent: dict[str, str] = {rid: "" for rid in job.ids}
    sent_tokens: dict[str, int] = {rid: 0 for rid in job.ids}
    totals: dict[str, tuple[int, int]] = {}
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    try:
        if req.echo:
            for rid in job.ids:
                i, index = choice_of[rid]
                yield _sse({"id": base, "object": "text_completion", "created": created, "model": model,
                            "choices": [{"index": index, "text": prompt_texts[i], "logprobs": None,
                                         "finish_reason": None}]})
        async for rid, out in job.outputs():
            text = out.text if out.finished else out.text[:len(out.text) - holdback_len(out.text, markers)]
            prev = sent[rid]
            delta = text[len(prev):] if text.startswith(prev) or len(text) > len(prev) else ""
            sent[rid] = prev + delta
            if not delta and not out.finished:
                continue
            _, index = choice_of[rid]
            lps = None
            if req.logprobs is not None:
                end = len(out.token_ids)
                lps = _completion_logprobs(tok, out, False, sent_tokens[rid], end, len(prev), req.logprobs,
                                           req.return_tokens_as_token_ids)
                sent_tokens[rid] = end
            choice = {"index": index, "text": delta, "logprobs": lps,
                      "finish_reason": out.finish_reason if out.finished else None}
            if out.finished:
                choice["stop_reason"] = out.stop_reason
                totals[rid] = (len(out.prompt_token_ids), len(out.token_ids))
            yield _sse({"id": base, "object": "text_completion", "created": created, "model": model,
                        "choices": [choice]})
        if include_usage:
            prompt_tokens = n_prompt
            yield _sse({"id": base, "object": "text_completion", "created": created, "model": model,
                        "choices": [], "usage": _usage(prompt_tokens, sum(c for _, c in totals.values()))})
        yield "data: [DONE]\n\n"
    except ApiError as exc:
        yield _sse({"error": {"message": exc.message, "type": "InternalServerError", "code": exc.status}})
        yield "data: [DONE]\n\n"
    finally:
        job.abort_unfinished()


# --------------------------------------------------------------------------- /v1/chat/completions
def _text_of(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") in ("text", "input_text"):
                parts.append(str(part.get("text", "")))
            elif isinstance(part, str):
                parts.append(part)
            else:
                raise ApiError(400, f"message content part of type {part.get('type') if isinstance(part, dict) else type(part).__name__!r} "
                                    "is not supported (text only)", param="messages")
        return "".join(parts)
    raise ApiError(400, "message content must be a string or a list of text parts", param="messages")


def _messages_for_template(state: Any, req: ChatCompletionRequest, tools: list | None) -> list[dict]:
    template = state.tokenizer.chat_template or ""
    renders_tool_calls = "tool_calls" in template
    msgs = []
    for k, m in enumerate(req.messages):
        role = m.get("role")
        if role not in ("system", "user", "assistant", "tool", "developer", "function"):
            raise ApiError(400, f"messages[{k}].role {role!r} is not one of system, user, assistant, tool",
                           param="messages")
        msg = {key: v for key, v in m.items() if key not in ("content",)}
        msg["role"] = "system" if role == "developer" else role
        msg["content"] = _text_of(m.get("content"))
        calls = m.get("tool_calls")
        if calls and not renders_tool_calls:
            blocks = []
            for c in calls:
                fn = c.get("function", {})
                args = fn.get("arguments", "{}")
                try:
                    args = json.loads(args) if isinstance(args, str) else args
                except json.JSONDecodeError:
                    pass
                blocks.append(f"{TOOL_OPEN}\n" + json.dumps({"name": fn.get("name"), "arguments": args},
                                                              ensure_ascii=False) + "\n</tool_call>")
            msg["content"] = (msg["content"] + "\n" if msg["content"] else "") + "\n".join(blocks)
            msg.pop("tool_calls", None)
        msgs.append(msg)
    if tools and "tools" not in template:
        prompt = tools_system_prompt(tools)
        if msgs and msgs[0]["role"] == "system":
            msgs[0] = {**msgs[0], "content": msgs[0]["content"] + "\n\n" + prompt}
        else:
            msgs.insert(0, {"role": "system", "content": prompt})
    return msgs


def _tool_mode(req: ChatCompletionRequest) -> tuple[str, dict | None]:
    """('none' | 'auto' | 'required' | 'named', the named function's spec)."""
    tools = req.tools or []
    choice = req.tool_choice
    if not tools:
        if choice not in (None, "none", "auto"):
            raise ApiError(400, "tool_choice needs `tools`", param="tool_choice")
        return "none", None
    for k, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type", "function") != "function" or \
                not isinstance(t.get("function", {}).get("name"), str):
            raise ApiError(400, f"tools[{k}] must be {{'type': 'function', 'function': {{'name': ..., "
                                "'parameters': {...}}}}", param="tools")
    if choice is None or choice == "auto":
        return "auto", None
    if choice in ("none", "required"):
        return choice, None
    name = (choice.get("function") or {}).get("name") if isinstance(choice, dict) else None
    for t in tools:
        if t["function"]["name"] == name:
            return "named", t["function"]
    raise ApiError(400, f"tool_choice names function {name!r}, which is not in `tools`", param="tool_choice")


def _tool_schema(mode: str, named: dict | None, tools: list) -> Any:
    if mode == "named":
        return named.get("parameters") or {"type": "object"}
    if mode == "required":
        alts = [{"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                                  "parameters": t["function"].get("parameters") or {"type": "object"}},
                 "required": ["name", "parameters"]} for t in tools]
        return {"type": "array", "minItems": 1, "items": {"anyOf": alts}}
    return None


def _forced_tool_calls(mode: str, named: dict | None, text: str) -> list[dict] | None:
    if mode == "named":
        return [make_tool_call(named["name"], text)]
    if mode == "required":
        try:
            items = json.loads(text)
        except json.JSONDecodeError:
            return None
        return [make_tool_call(it["name"], it.get("parameters", {})) for it in items if isinstance(it, dict)]
    return None


def _chat_logprobs(tok: Any, out: Any, start: int, end: int, top_n: int, as_ids: bool = False) -> list[dict]:
    items = []
    for k in range(start, end):
        tid = out.token_ids[k]
        d = (out.logprobs[k] if out.logprobs and k < len(out.logprobs) else {}) or {}
        s = _token_str(tok, tid, as_ids)
        ranked = sorted(d.items(), key=lambda kv: -kv[1])[:top_n]
        items.append({"token": s, "logprob": d.get(tid, float("nan")), "bytes": list(s.encode("utf-8")),
                      "top_logprobs": [{"token": _token_str(tok, t, as_ids), "logprob": v,
                                        "bytes": list(_token_str(tok, t, as_ids).encode("utf-8"))} for t, v in ranked]})
    return items


@dataclass
class _ChoiceView:
    """How one choice's raw text maps onto reasoning / content / tool calls."""

    reasoning_on: bool
    starts_in_reasoning: bool
    tool_mode: str
    named: dict | None

    def split(self, text: str) -> tuple[str | None, str]:
        if self.reasoning_on:
            return split_reasoning(text, self.starts_in_reasoning)
        return None, text

    def final_message(self, text: str) -> tuple[dict, bool]:
        reasoning, content = self.split(text)
        msg: dict[str, Any] = {"role": "assistant", "content": content}
        if reasoning is not None:
            msg["reasoning_content"] = reasoning
        called = False
        if self.tool_mode in ("named", "required"):
            calls = _forced_tool_calls(self.tool_mode, self.named, content)
            if calls:
                msg["content"], msg["tool_calls"], called = None, calls, True
        elif self.tool_mode == "auto":
            rest, calls = parse_tool_calls(content)
            if calls:
                msg["content"], msg["tool_calls"], called = rest, calls, True
        if "tool_calls" not in msg:
            msg["tool_calls"] = []
        return msg, called


async def create_chat_completion(state: Any, req: ChatCompletionRequest, request: Any):
    model = _check_common(state, req)
    mode, named = _tool_mode(req)
    tools = req.tools if mode != "none" else None
    msgs = _messages_for_template(state, req, tools)
    template_tools = tools if tools and "tools" in (state.tokenizer.chat_template or "") else None
    kw = dict(req.chat_template_kwargs or {})
    if req.reasoning_effort:
        kw.setdefault("reasoning_effort", req.reasoning_effort)
    try:
        prompt = state.tokenizer.apply_chat_template(msgs, add_generation_prompt=req.add_generation_prompt,
                                                     tools=template_tools, **kw)
    except Exception as exc:  # noqa: BLE001 - template errors are the caller's messages
        raise ApiError(400, f"the chat template could not render these messages: {exc}", param="messages") from None
    ids = state.tokenizer.encode(prompt, add_special_tokens=False)
    requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    mt = _max_tokens(state, requested, len(ids))
    if mt == 0:
        raise ApiError(400, "max_tokens=0 generates nothing", param="max_tokens")
    top_n = req.top_logprobs or 0
    if req.top_logprobs is not None and not req.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
    schema = _tool_schema(mode, named, req.tools or [])
    view = _ChoiceView(state.reasoning_parser != "none",
                       prompt.rstrip().endswith(THINK_OPEN), mode, named)
    base = req.request_id or f"chatcmpl-{uuid.uuid4().hex}"
    job = _Job(state)
    index_of: dict[str, int] = {}
    try:
        for j in range(req.n):
            proc = _grammar_processor(state, req, schema_override=schema)
            params = _sampling_params(req, mt, j, logprobs=top_n if req.logprobs else None, prompt_logprobs=None,
                                      processors=[proc] if proc else None)
            rid = f"{base}-{j}"
            index_of[rid] = j
            await job.add(rid, ids, params)
    except BaseException:
        job.abort_unfinished()
        raise
    created = int(time.time())
    if req.stream:
        return _stream_chat(state, req, job, base, model, created, index_of, view, len(ids), top_n)
    finals = await _collect_finals(job, request)
    choices = []
    tok = state.tokenizer
    for rid in job.ids:
        out = finals[rid]
        msg, called = view.final_message(out.text)
        finish = "tool_calls" if called else out.finish_reason
        choices.append({"index": index_of[rid], "message": msg,
                        "logprobs": {"content": _chat_logprobs(tok, out, 0, len(out.token_ids), top_n, req.return_tokens_as_token_ids)}
                        if req.logprobs else None,
                        "finish_reason": finish, "stop_reason": out.stop_reason})
    n_out = sum(len(o.token_ids) for o in finals.values())
    cached = max((o.num_cached_tokens for o in finals.values()), default=0)
    return {"id": base, "object": "chat.completion", "created": created, "model": model, "choices": choices,
            "usage": _usage(len(ids), n_out, cached)}


async def _stream_chat(state, req, job: _Job, base, model, created, index_of, view: _ChoiceView,
                       prompt_len: int, top_n: int):
    tok = state.tokenizer
    stops = list(req.stop if isinstance(req.stop, list) else [req.stop] if req.stop else [])
    markers = stops + ([THINK_OPEN, THINK_CLOSE] if view.reasoning_on else []) + \
        ([TOOL_OPEN] if view.tool_mode == "auto" else [])
    buffered = view.tool_mode in ("named", "required")
    sent_r = {rid: "" for rid in job.ids}
    sent_c = {rid: "" for rid in job.ids}
    sent_tok = {rid: 0 for rid in job.ids}
    completion_tokens: dict[str, int] = {}
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)

    def chunk(index: int, delta: dict, finish: str | None = None, logprobs: Any = None, extra: dict | None = None):
        c = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        if extra:
            c.update(extra)
        body = {"id": base, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [c]}
        if continuous and include_usage:
            n = sum(completion_tokens.values())
            body["usage"] = _usage(prompt_len, n)
        return _sse(body)

    try:
        for rid in job.ids:
            yield chunk(index_of[rid], {"role": "assistant", "content": ""})
        async for rid, out in job.outputs():
            index = index_of[rid]
            completion_tokens[rid] = len(out.token_ids)
            text = out.text if out.finished else out.text[:len(out.text) - holdback_len(out.text, markers)]
            reasoning, content = view.split(text)
            delta: dict[str, Any] = {}
            if reasoning is not None and len(reasoning) > len(sent_r[rid]) and reasoning.startswith(sent_r[rid]):
                delta["reasoning_content"] = reasoning[len(sent_r[rid]):]
                sent_r[rid] = reasoning
            visible = "" if buffered else (content_before_tools(content) if view.tool_mode == "auto" else content)
            if len(visible) > len(sent_c[rid]):
                delta["content"] = visible[len(sent_c[rid]):]
                sent_c[rid] = visible
            lps = None
            if req.logprobs and (delta or out.finished):
                end = len(out.token_ids)
                lps = {"content": _chat_logprobs(tok, out, sent_tok[rid], end, top_n, req.return_tokens_as_token_ids)}
                sent_tok[rid] = end
            if not out.finished:
                if delta:
                    yield chunk(index, delta, logprobs=lps)
                continue
            msg, called = view.final_message(out.text)
            if called:
                delta["tool_calls"] = [{"index": k, **c} for k, c in enumerate(msg["tool_calls"])]
            elif buffered and content and len(content) > len(sent_c[rid]):
                delta["content"] = content[len(sent_c[rid]):]
            finish = "tool_calls" if called else out.finish_reason
            yield chunk(index, delta, finish, lps, {"stop_reason": out.stop_reason})
        if include_usage:
            body = {"id": base, "object": "chat.completion.chunk", "created": created, "model": model,
                    "choices": [], "usage": _usage(prompt_len, sum(completion_tokens.values()))}
            yield _sse(body)
        yield "data: [DONE]\n\n"
    except ApiError as exc:
        yield _sse({"error": {"message": exc.message, "type": "InternalServerError", "code": exc.status}})
        yield "data: [DONE]\n\n"
    finally:
        job.abort_unfinished()
