"""A streaming OpenAI-API client that times what a user sees: TTFT, inter-token gaps, end-to-end.

Shared by the `openai` engine adapter, the `endpoint` load runner and the server load benchmark.
Times are client-side (`time.perf_counter`), from just before the request is sent. A token gap
is counted per streamed content chunk; servers that pack several tokens into one chunk are
corrected by the token count from the final `usage` (TPOT = (e2e - TTFT) / (tokens - 1)).
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx


@dataclass
class StreamResult:
    status: int = 0
    ok: bool = False
    text: str = ""
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    chunk_gaps_s: list[float] = field(default_factory=list)  # between successive content chunks
    num_chunks: int = 0
    disconnected: bool = False  # the client left on purpose before the end
    error: str | None = None
    token_ids: list[int] = field(default_factory=list)

    @property
    def tpot_s(self) -> float | None:
        n = self.completion_tokens or self.num_chunks
        if self.ttft_s is None or self.e2e_s is None or not n or n < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (n - 1)


def _content_of(choice: dict, chat: bool) -> str:
    if not chat:
        return choice.get("text") or ""
    delta = choice.get("delta") or {}
    return (delta.get("content") or "") + (delta.get("reasoning_content") or delta.get("reasoning") or "")


def _token_ids_of(lp: dict | None, chat: bool) -> list[int]:
    """Token ids from logprobs written as "token_id:N" (vLLM's return_tokens_as_token_ids)."""
    if not lp:
        return []
    toks = [c.get("token", "") for c in lp.get("content") or []] if chat else list(lp.get("tokens") or [])
    ids = []
    for t in toks:
        if isinstance(t, str) and t.startswith("token_id:"):
            ids.append(int(t[9:]))
    return ids


async def stream_completion(client: httpx.AsyncClient, url: str, body: dict, *, chat: bool,
                            headers: dict | None = None, disconnect_after_chunks: int | None = None,
                            timeout_s: float | None = None) -> StreamResult:
    """POST `body` with stream=true (usage requested) and read the SSE stream to the end
    (or leave after `disconnect_after_chunks` content chunks)."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    res = StreamResult()
    t0 = time.perf_counter()
    last = None
    try:
        async with client.stream("POST", url, json=body, headers=headers, timeout=timeout_s) as r:
            res.status = r.status_code
            if r.status_code != 200:
                raw = await r.aread()
                res.error = raw.decode(errors="replace")[:500]
                res.e2e_s = time.perf_counter() - t0
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                if "error" in obj:
                    res.error = json.dumps(obj["error"])[:500]
                    break
                now = time.perf_counter()
                if obj.get("usage"):
                    res.prompt_tokens = obj["usage"].get("prompt_tokens")
                    res.completion_tokens = obj["usage"].get("completion_tokens")
                for choice in obj.get("choices") or []:
                    piece = _content_of(choice, chat)
                    lp = choice.get("logprobs")
                    res.token_ids.extend(_token_ids_of(lp, chat))
                    if piece or (lp and not chat and lp.get("tokens")):
                        if res.ttft_s is None:
                            res.ttft_s = now - t0
                        elif last is not None:
                            res.chunk_gaps_s.append(now - last)
                        last = now
                        res.num_chunks += 1
                        res.text += piece
                    if choice.get("finish_reason"):
                        res.finish_reason = choice["finish_reason"]
                if disconnect_after_chunks is not None and res.num_chunks >= disconnect_after_chunks:
                    res.disconnected = True
                    break
        res.e2e_s = time.perf_counter() - t0
        res.ok = res.error is None and (res.disconnected or res.finish_reason is not None)
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"
        res.e2e_s = time.perf_counter() - t0
    return res


def parse_prometheus(text: str) -> dict[str, float]:
    """`name{labels}` -> value, summed over label sets with the same name and `position` kept apart."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        try:
            key, value = line.rsplit(" ", 1)
            v = float(value)
        except ValueError:
            continue
        name = key.split("{", 1)[0]
        if name.endswith("_created"):
            continue
        if "position=" in key:
            pos = key.split('position="', 1)[1].split('"', 1)[0]
            name = f"{name}[{pos}]"
        out[name] = out.get(name, 0.0) + v
    return out


def metrics_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after.get(k, 0.0) - before.get(k, 0.0) for k in set(before) | set(after)}


def spec_acceptance(delta: dict[str, float]) -> dict[str, Any]:
    """Speculative-decoding figures of a run from a /metrics difference (vLLM names)."""
    drafts = delta.get("vllm:spec_decode_num_drafts_total", 0.0)
    draft_tokens = delta.get("vllm:spec_decode_num_draft_tokens_total", 0.0)
    accepted = delta.get("vllm:spec_decode_num_accepted_tokens_total", 0.0)
    per_pos = sorted((int(k.split("[")[1].rstrip("]")), v) for k, v in delta.items()
                     if k.startswith("vllm:spec_decode_num_accepted_tokens_per_pos_total["))
    return {"num_drafts": drafts, "num_draft_tokens": draft_tokens, "num_accepted_tokens": accepted,
            "acceptance_rate": accepted / draft_tokens if draft_tokens else None,
            "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
            "accepted_per_position": [v for _, v in per_pos]}
