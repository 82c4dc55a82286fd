"""/v1/chat/completions: messages -> chat template -> engine requests -> OpenAI chat completions.

The reply text is split into reasoning (`<think>`), content and tool calls (parsers.py). Streaming
deltas never take text back: tails that may still become a stop string or a tag are held back.
Templating and tokenizing run on a worker thread (cpu_work.py).
"""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from onecat.engine.server import cpu_work
from onecat.engine.server.chat_prompt import render_prompt, tool_dicts, tool_mode, tool_schema
from onecat.engine.server.errors import ApiError
from onecat.engine.server.logprob_format import chat_logprobs
from onecat.engine.server.parsers import (THINK_CLOSE, THINK_OPEN, TOOL_OPEN, content_before_tools, make_tool_call,
                                          parse_tool_calls, split_reasoning)
from onecat.engine.server.protocol import ChatCompletionRequest
from onecat.engine.server.sampling_body import params_from_body
from onecat.engine.server.serving import (Job, check_common, collect_finals, grammar_processor, max_tokens_for,
                                          event_stream, sse, submit_all, usage)
from onecat.engine.server.streaming import holdback_len

if TYPE_CHECKING:
    from onecat.engine.server.state import ServerState


def _forced_tool_calls(mode: str, named: dict | None, text: str) -> list[dict] | None:
    if mode == "named":
        return [make_tool_call(named["name"], text)]
    if mode == "required":
        try:
            items = json.loads(text)
        except ValueError:
            return None
        if not isinstance(items, list):
            return None
        return [make_tool_call(it["name"], it.get("parameters", {})) for it in items
                if isinstance(it, dict) and isinstance(it.get("name"), str)]
    return None


@dataclass
class ChoiceView:
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


def _prompt_and_ids(state: ServerState, req: ChatCompletionRequest, tools: list[dict] | None) -> tuple[str, list[int]]:
    kw = dict(req.chat_template_kwargs or {})
    if req.reasoning_effort:
        kw.setdefault("reasoning_effort", req.reasoning_effort)
    prompt = render_prompt(state.tokenizer, req.messages, tools, add_generation_prompt=req.add_generation_prompt,
                           template_kwargs=kw)
    return prompt, cpu_work.encode(state.tokenizer, prompt, add_special_tokens=False)


async def create_chat_completion(state: ServerState, req: ChatCompletionRequest, request: Any):
    model = check_common(state, req)
    all_tools = tool_dicts(req.tools)
    mode, named = tool_mode(all_tools, req.tool_choice)
    if req.top_logprobs is not None and not req.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
    prompt, ids = await state.cpu.run(_prompt_and_ids, state, req, all_tools if mode != "none" else None)
    requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    mt = max_tokens_for(state, requested, len(ids))
    if mt == 0:
        raise ApiError(400, "max_tokens=0 generates nothing", param="max_tokens")
    top_n = req.top_logprobs or 0
    schema = tool_schema(mode, named, all_tools or [])
    view = ChoiceView(state.reasoning_parser != "none", prompt.rstrip().endswith(THINK_OPEN), mode, named)
    base = req.request_id or f"chatcmpl-{uuid.uuid4().hex}"
    index_of: dict[str, int] = {}
    submissions = []
    for j in range(req.n):
        proc = await grammar_processor(state, req, schema_override=schema)
        params = params_from_body(req, mt, j, logprobs=top_n if req.logprobs else None, prompt_logprobs=None,
                                  processors=[proc] if proc else None)
        rid = f"{base}-{j}"
        index_of[rid] = j
        submissions.append((rid, ids, params))
    job = Job(state)
    await submit_all(job, submissions)
    created = int(time.time())
    if req.stream:
        return event_stream(job, _stream_chat(state, req, job, base, model, created, index_of, view, len(ids),
                                                top_n))
    finals = await collect_finals(job, request)
    choices = []
    tok = state.tokenizer
    for rid in job.ids:
        out = finals[rid]
        msg, called = view.final_message(out.text)
        finish = "tool_calls" if called else out.finish_reason
        lps = {"content": chat_logprobs(tok, out, 0, len(out.token_ids), top_n, req.return_tokens_as_token_ids)} \
            if req.logprobs else None
        choices.append({"index": index_of[rid], "message": msg, "logprobs": lps,
                        "finish_reason": finish, "stop_reason": out.stop_reason})
    n_out = sum(len(o.token_ids) for o in finals.values())
    cached = max((o.num_cached_tokens for o in finals.values()), default=0)
    return {"id": base, "object": "chat.completion", "created": created, "model": model, "choices": choices,
            "usage": usage(len(ids), n_out, cached)}


async def _stream_chat(state: ServerState, req, job: Job, base, model, created, index_of, view: ChoiceView,
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
            body["usage"] = usage(prompt_len, sum(completion_tokens.values()))
        return sse(body)

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
            lps = {"content": chat_logprobs(tok, out, sent_tok[rid], end, top_n, req.return_tokens_as_token_ids)}
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
                "choices": [], "usage": usage(prompt_len, sum(completion_tokens.values()))}
        yield sse(body)
