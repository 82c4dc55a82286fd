"""What /v1/completions and /v1/chat/completions share: request checks, grammar processors, and the
`Job` that carries one HTTP call's engine requests (a body's sampling settings become SamplingParams in
sampling_body.py).

One HTTP request becomes `n` engine requests per prompt (the engine samples one sequence per
request; choice j gets seed + j when a seed is given). A client that goes away aborts every engine
request of its call, which frees their KV blocks. The endpoints themselves live in completions.py
and chat.py.
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, AsyncIterator

from onecat.engine.sampling_params import SamplingParams
from onecat.engine.server.async_engine import EngineRequestError, QueueFullError, RequestRejected
from onecat.engine.server.errors import ApiError, ClientDisconnected, error_body
from onecat.engine.server.guided import GrammarError

if TYPE_CHECKING:
    from onecat.engine.server.state import ServerState


def check_common(state: ServerState, req: Any) -> str:
    """The served model name, after refusing what no engine request could carry."""
    model = state.resolve_model_name(req.model)
    bad = req.unsupported()
    if bad:
        raise ApiError(400, f"{', '.join(bad)} is not supported by this server; leave it at its default",
                       param=bad[0])
    vocab = state.vocab_size
    outside = [t for t in req.stop_token_ids or [] if t >= vocab]
    if outside:
        raise ApiError(400, f"stop_token_ids {outside[:5]} are outside the vocabulary [0, {vocab})",
                       param="stop_token_ids")
    return model


def max_tokens_for(state: ServerState, requested: int | None, prompt_len: int) -> int | None:
    limit = state.max_model_len
    if prompt_len >= limit:
        raise ApiError(400, f"This model's maximum context length is {limit} tokens. However, your prompt has "
                            f"{prompt_len} tokens; shorten the prompt", param="messages")
    if requested is None:
        return limit - prompt_len
    if prompt_len + requested > limit:
        raise ApiError(400, f"This model's maximum context length is {limit} tokens. However, you requested "
                            f"{prompt_len + requested} tokens ({prompt_len} in the prompt, {requested} for the "
                            "completion). Reduce the prompt or max_tokens.", param="max_tokens")
    return requested


def _compile_grammar_processor(state: ServerState, req: Any, schema_override: Any):
    try:
        grammar = state.grammar_for(req, schema_override)
        return None if grammar is None else state.guided().processor(grammar)
    except GrammarError as exc:
        raise ApiError(400, str(exc), param="response_format") from None


async def grammar_processor(state: ServerState, req: Any, *, schema_override: Any = None):
    """A fresh logits processor for one engine request, or None when unconstrained. Compiled on a
    worker thread: a large schema (and the first use, which builds the grammar tokenizer) takes a while."""
    if schema_override is None and not req.constrained():
        return None
    return await state.cpu.run(_compile_grammar_processor, state, req, schema_override)


@dataclass
class Job:
    """The engine requests of one HTTP call, sharing one output queue."""

    state: ServerState
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    ids: list[str] = field(default_factory=list)
    finished: set = field(default_factory=set)

    async def add(self, rid: str, prompt_ids: list[int], params: SamplingParams) -> None:
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


async def submit_all(job: Job, submissions) -> None:
    """Submit (request id, prompt ids, params) triples; on any refusal abort what was already submitted."""
    try:
        for rid, ids, params in submissions:
            await job.add(rid, ids, params)
    except BaseException:
        job.abort_unfinished()
        raise


async def collect_finals(job: Job, request: Any) -> dict[str, Any]:
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


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def sse_error(exc: ApiError) -> str:
    """An error met after the stream started (the status line is already 200)."""
    return sse(error_body(exc.message, exc.status, param=exc.param))


DONE = "data: [DONE]\n\n"


async def event_stream(job: Job, chunks: AsyncIterator[str]) -> AsyncIterator[str]:
    """The frame every streamed response shares: the endpoint's chunks, then `[DONE]`; an error met
    mid-stream becomes an error event before `[DONE]`; a client that goes away aborts what is unfinished."""
    try:
        async for chunk in chunks:
            yield chunk
        yield DONE
    except ApiError as exc:
        yield sse_error(exc)
        yield DONE
    finally:
        job.abort_unfinished()


def usage(prompt_tokens: int, completion_tokens: int, cached: int = 0) -> dict:
    u = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
         "total_tokens": prompt_tokens + completion_tokens}
    if cached:
        u["prompt_tokens_details"] = {"cached_tokens": cached}
    return u
