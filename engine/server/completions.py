"""/v1/completions: prompts (strings or token ids) -> engine requests -> OpenAI text completions.

Streaming answers are Server-Sent Events whose deltas never take text back (see streaming.py).
Tokenizing runs on a worker thread (cpu_work.py) so a huge prompt cannot stall the event loop.
"""
from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING, Any

from onecat.engine.server import cpu_work
from onecat.engine.server.errors import ApiError
from onecat.engine.server.logprob_format import completion_logprobs, prompt_logprobs
from onecat.engine.server.protocol import CompletionRequest
from onecat.engine.server.sampling_body import params_from_body
from onecat.engine.server.serving import (Job, check_common, collect_finals, grammar_processor, max_tokens_for,
                                          event_stream, sse, submit_all, usage)
from onecat.engine.server.streaming import holdback_len

if TYPE_CHECKING:
    from onecat.engine.server.state import ServerState


def _split_prompts(req: CompletionRequest) -> list:
    p = req.prompt
    if isinstance(p, str):
        return [p]
    if p and all(isinstance(x, int) for x in p):
        return [p]
    return list(p)


def _tokenize_all(state: ServerState, items: list, add_special_tokens: bool) -> list[tuple[str | None, list[int]]]:
    out = []
    for item in items:
        if isinstance(item, str):
            out.append((item, cpu_work.encode(state.tokenizer, item, add_special_tokens)))
        else:
            out.append((None, list(item)))
        if not out[-1][1]:
            raise ApiError(400, "a prompt has no tokens; give at least one", param="prompt")
    return out


async def _prompts_of(state: ServerState, req: CompletionRequest) -> list[tuple[str | None, list[int]]]:
    items = _split_prompts(req)
    if not items:
        raise ApiError(400, "prompt is empty; give a string, a list of strings or token ids", param="prompt")
    prompts = await state.cpu.run(_tokenize_all, state, items, req.add_special_tokens)
    vocab = state.vocab_size
    for _, ids in prompts:
        outside = [t for t in ids if t >= vocab]
        if outside:
            raise ApiError(400, f"prompt token ids {outside[:5]} are outside the vocabulary [0, {vocab})",
                           param="prompt")
    return prompts


def _prompt_texts(state: ServerState, prompts: list) -> list[str]:
    return [t if t is not None else cpu_work.decode(state.tokenizer, ids, skip_special_tokens=False)
            for t, ids in prompts]


async def create_completion(state: ServerState, req: CompletionRequest, request: Any):
    model = check_common(state, req)
    if req.suffix:
        raise ApiError(400, "suffix is not supported", param="suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise ApiError(400, "best_of other than n is not supported", param="best_of")
    if req.prompt_logprobs is not None and req.stream:
        raise ApiError(400, "prompt_logprobs is not streamed; send the request with stream=false",
                       param="prompt_logprobs")
    if req.max_tokens == 0 and not req.echo:
        raise ApiError(400, "max_tokens=0 generates nothing; use echo=true with logprobs to score a prompt",
                       param="max_tokens")
    prompts = await _prompts_of(state, req)
    if len(prompts) * req.n > state.engine.max_in_flight:
        raise ApiError(400, f"{len(prompts)} prompts x n={req.n} engine requests is more than this server holds at "
                            f"once ({state.engine.max_in_flight}); send fewer per call", param="prompt")
    # echo with logprobs=N scores the prompt with the N likeliest tokens at each position (what lm-eval
    # reads "is greedy" off); prompt_logprobs=N asks for the same in vLLM's shape
    asked = [n for n in (req.prompt_logprobs, req.logprobs if req.echo else None) if n is not None]
    want_prompt_lps = max(asked) if asked else (0 if req.max_tokens == 0 else None)
    base = req.request_id or f"cmpl-{uuid.uuid4().hex}"
    choice_of: dict[str, tuple[int, int]] = {}
    submissions = []
    for i, (_, ids) in enumerate(prompts):
        mt = max_tokens_for(state, req.max_tokens, len(ids))
        for j in range(req.n):
            proc = await grammar_processor(state, req)
            params = params_from_body(req, mt, j, logprobs=req.logprobs, prompt_logprobs=want_prompt_lps,
                                      processors=[proc] if proc else None)
            rid = f"{base}-{i}-{j}"
            choice_of[rid] = (i, i * req.n + j)
            submissions.append((rid, ids, params))
    job = Job(state)
    await submit_all(job, submissions)
    created = int(time.time())
    tok = state.tokenizer
    prompt_texts = await state.cpu.run(_prompt_texts, state, prompts) if req.echo else [""] * len(prompts)
    n_prompt = sum(len(ids) for _, ids in prompts)
    if req.stream:
        return event_stream(job, _stream_completion(state, req, job, base, model, created, choice_of,
                                                      prompt_texts, n_prompt))
    finals = await collect_finals(job, request)
    choices = []
    for rid in job.ids:
        i, index = choice_of[rid]
        out = finals[rid]
        text = (prompt_texts[i] if req.echo else "") + out.text
        lps = None
        if req.logprobs is not None:
            lps = completion_logprobs(tok, out, req.echo, 0, len(out.token_ids), 0, req.logprobs,
                                      req.return_tokens_as_token_ids)
        choice = {"index": index, "text": text, "logprobs": lps, "finish_reason": out.finish_reason,
                  "stop_reason": out.stop_reason}
        if req.prompt_logprobs is not None:
            choice["prompt_logprobs"] = prompt_logprobs(tok, out)
        choices.append(choice)
    choices.sort(key=lambda c: c["index"])
    n_out = sum(len(o.token_ids) for o in finals.values())
    cached = sum(o.num_cached_tokens for o in finals.values())
    return {"id": base, "object": "text_completion", "created": created, "model": model, "choices": choices,
            "usage": usage(n_prompt, n_out, cached)}


async def _stream_completion(state: ServerState, req, job: Job, base, model, created, choice_of, prompt_texts,
                             n_prompt):
    tok = state.tokenizer
    markers = list(req.stop if isinstance(req.stop, list) else [req.stop] if req.stop else [])
    sent: dict[str, str] = {rid: "" for rid in job.ids}
    sent_tokens: dict[str, int] = {rid: 0 for rid in job.ids}
    totals: dict[str, tuple[int, int]] = {}
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    if req.echo:
        for rid in job.ids:
            i, index = choice_of[rid]
            yield sse({"id": base, "object": "text_completion", "created": created, "model": model,
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
            lps = completion_logprobs(tok, out, False, sent_tokens[rid], end, len(prev), req.logprobs,
                                      req.return_tokens_as_token_ids)
            sent_tokens[rid] = end
        choice = {"index": index, "text": delta, "logprobs": lps,
                  "finish_reason": out.finish_reason if out.finished else None}
        if out.finished:
            choice["stop_reason"] = out.stop_reason
            totals[rid] = (len(out.prompt_token_ids), len(out.token_ids))
        yield sse({"id": base, "object": "text_completion", "created": created, "model": model,
                   "choices": [choice]})
    if include_usage:
        yield sse({"id": base, "object": "text_completion", "created": created, "model": model,
                   "choices": [], "usage": usage(n_prompt, sum(c for _, c in totals.values()))})
