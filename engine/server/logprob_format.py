"""Log-probabilities in the OpenAI shapes (completions and chat), always as finite JSON numbers.

A grammar masks forbidden tokens to -inf, and strict JSON has no -inf or NaN: like vLLM, a
log-probability is clamped to -9999.0, and a missing one is null.
"""
from __future__ import annotations

import math
from typing import Any

FLOOR = -9999.0


def finite(lp: float | None) -> float | None:
    if lp is None or math.isnan(lp):
        return None
    return max(float(lp), FLOOR)


def token_str(tok: Any, tid: int, as_ids: bool = False) -> str:
    return f"token_id:{tid}" if as_ids else tok.decode([tid], skip_special_tokens=False)


def completion_logprobs(tok: Any, out: Any, echo: bool, start: int, end: int, offset0: int,
                        top_n: int, as_ids: bool = False) -> dict:
    """/v1/completions `logprobs` for output tokens [start, end) (and the prompt when echo)."""
    tokens, token_lps, tops, offsets = [], [], [], []
    pos = offset0
    if echo:
        plp = out.prompt_logprobs or [None] * len(out.prompt_token_ids)
        for i, tid in enumerate(out.prompt_token_ids):
            s = token_str(tok, tid, as_ids)
            lp = finite(plp[i]) if i < len(plp) else None
            tokens.append(s)
            token_lps.append(lp)
            tops.append(None if lp is None else {s: lp})
            offsets.append(pos)
            pos += len(tok.decode([tid], skip_special_tokens=False)) if as_ids else len(s)
    for k in range(start, end):
        tid = out.token_ids[k]
        s = token_str(tok, tid, as_ids)
        d = (out.logprobs[k] if out.logprobs and k < len(out.logprobs) else {}) or {}
        tokens.append(s)
        token_lps.append(finite(d.get(tid)))
        ranked = sorted(d.items(), key=lambda kv: -kv[1])
        top = {}
        for t, v in ranked[:max(top_n, 1)]:
            top.setdefault(token_str(tok, t, as_ids), finite(v))
        if s not in top and tid in d:
            top[s] = finite(d[tid])
        tops.append(top)
        offsets.append(pos)
        pos += len(tok.decode([tid], skip_special_tokens=False)) if as_ids else len(s)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(tok: Any, out: Any, start: int, end: int, top_n: int, as_ids: bool = False) -> list[dict]:
    """/v1/chat/completions `logprobs.content` for output tokens [start, end)."""
    items = []
    for k in range(start, end):
        tid = out.token_ids[k]
        d = (out.logprobs[k] if out.logprobs and k < len(out.logprobs) else {}) or {}
        s = token_str(tok, tid, as_ids)
        ranked = sorted(d.items(), key=lambda kv: -kv[1])[:top_n]
        lp = finite(d.get(tid))
        items.append({"token": s, "logprob": FLOOR if lp is None else lp, "bytes": list(s.encode("utf-8")),
                      "top_logprobs": [{"token": token_str(tok, t, as_ids), "logprob": finite(v),
                                        "bytes": list(token_str(tok, t, as_ids).encode("utf-8"))}
                                       for t, v in ranked]})
    return items


def prompt_logprobs(values: list | None) -> list | None:
    """vLLM's `prompt_logprobs` passed through, made finite."""
    if values is None:
        return None
    return [{k: finite(v) for k, v in item.items()} if isinstance(item, dict) else
            (finite(item) if isinstance(item, (int, float)) else item) for item in values]
