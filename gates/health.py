"""Natural-stop health of one generation: did it end on its own, loop, or emit broken text?

Every generating runner stores these fields per request (RequestRecord), so quality regressions
that do not show up in a score (a fast path that makes the model ramble to the cap, loop, or
produce U+FFFD from mangled bytes) are still caught by the natural_stop_rate check.

    generation_health(output, tokenizer=None) -> dict with
        finish_reason, natural_stop (ended by EOS/stop string), capped (hit max_tokens),
        max_repeat_run (longest stretch, in tokens, that repeats the stretch just before it with a
        period of 1..MAX_PERIOD tokens), repetition_loop (max_repeat_run >= LOOP_MIN_TOKENS),
        replacement_chars (count of U+FFFD in the text), token_sha256, text_sha256
"""
from __future__ import annotations

import hashlib
import struct
from typing import Any, Sequence

MAX_PERIOD = 16
LOOP_MIN_TOKENS = 32


def token_sha256(token_ids: Sequence[int]) -> str:
    """Hash of the token ids as little-endian int64 (independent of how they were produced)."""
    return hashlib.sha256(struct.pack(f"<{len(token_ids)}q", *token_ids)).hexdigest()


def text_sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", errors="surrogatepass")).hexdigest()


def max_repeat_run(token_ids: Sequence[int], max_period: int = MAX_PERIOD) -> int:
    """Longest run of tokens where tokens[i] == tokens[i - p] for some fixed period p (counted
    as the repeated tokens plus the first period), 0 when nothing repeats."""
    best = 0
    n = len(token_ids)
    for p in range(1, min(max_period, n - 1) + 1):
        run = 0
        for i in range(p, n):
            if token_ids[i] == token_ids[i - p]:
                run += 1
                if run + p > best:
                    best = run + p
            else:
                run = 0
    # a single repeated pair of short period is not a loop; require the pattern to occur twice
    return best if best >= 2 else 0


def generation_health(output: Any, tokenizer: Any = None) -> dict[str, Any]:
    ids = list(output.token_ids)
    text = output.text
    if (text is None or text == "") and ids and tokenizer is not None:
        text = tokenizer.decode(ids)
    text = text or ""
    finish = output.finish_reason
    run = max_repeat_run(ids)
    return {
        "finish_reason": finish,
        "natural_stop": finish == "stop",
        "capped": finish == "length",
        "max_repeat_run": run,
        "repetition_loop": run >= LOOP_MIN_TOKENS,
        "replacement_chars": text.count("\ufffd"),
        "token_sha256": token_sha256(ids),
        "text_sha256": text_sha256(text),
    }
