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
        ptops = out.prompt_top_logprobs or [None] * len(out.prompt_token_ids)
        for i, tid in enumerate(out.prompt_token_ids):
            s = token_str(tok, tid, as_ids)
            lp = finite(plp[i]) if i < len(plp) else None
            tokens.append(s)
            token_lps.append(lp)
            # the likeliest tokens at this position (lm-eval reads "is greedy" off them), then the token itself
            tops.append(None if lp is None else
                        _top_dict(tok, ptops[i] if i < len(ptops) else None, tid, lp, top_n, as_ids))
            offsets.append(pos)
            pos += len(tok.decode([tid], skip_special_tokens=False)) if as_ids else len(s)
    for k in range(start, end):
        tid = out.token_ids[k]
        s = token_str(tok, tid, as_ids)
        d = (out.logprobs[k] if out.logprobs and k < len(out.logprobs) else {}) or {}
        tokens.append(s)
        token_lps.append(finite(d.get(tid)))
        tops.append(_top_dict(tok, d, tid, d.get(tid), top_n, as_ids))
        offsets.append(pos)
        pos += len(tok.decode([tid], skip_special_tokens=False)) if as_ids else len(s)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def _top_dict(tok: Any, alternatives: dict[int, float] | None, tid: int, lp: float | None, top_n: int,
              as_ids: bool) -> dict:
    """OpenAI's top_logprobs entry: the max(top_n, 1) likeliest of `alternatives`, then the token itself."""
    top = {}
    for t, v in sorted((alternatives or {}).items(), key=lambda kv: -kv[1])[:max(top_n, 1)]:
        top.setdefault(token_str(tok, t, as_ids), finite(v))
    s = token_str(tok, tid, as_ids)
    if s not in top and lp is not None:
        top[s] = finite(lp)
    return top


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


def prompt_logprobs(tok: Any, out: Any) -> list | None:
    """vLLM's `prompt_logprobs`: per prompt token (None for the first) {token id: {logprob, rank,
    decoded_token}} holding the prompt's own token and, for N > 0, the N likeliest tokens there."""
    if out.prompt_logprobs is None:
        return None
    n = len(out.prompt_token_ids)
    tops = out.prompt_top_logprobs or [None] * n
    ranks = out.prompt_ranks or [None] * n
    result: list = []
    for i, (tid, lp) in enumerate(zip(out.prompt_token_ids, out.prompt_logprobs)):
        if lp is None:
            result.append(None)
            continue
        entry = {str(tid): {"logprob": finite(lp), "rank": ranks[i] if i < len(ranks) else None,
                            "decoded_token": token_str(tok, tid)}}
        ranked = sorted((tops[i] or {}).items(), key=lambda kv: -kv[1]) if i < len(tops) else []
        for r, (t, v) in enumerate(ranked, start=1):
            entry.setdefault(str(t), {"logprob": finite(v), "rank": r, "decoded_token": token_str(tok, t)})
        result.append(entry)
    return result
