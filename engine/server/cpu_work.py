"""CPU-heavy request work (tokenizing, chat templating, detokenizing, grammar compiling) off the
event loop, on a small pool of worker threads.

A thread only helps when the work lets go of the GIL. The `tokenizers` library holds it through
`Tokenizer.encode` (a 6 MB prompt then stalls every other request, /health included, for
seconds) but releases it in the batch calls, so `encode` here goes through `encode_batch_fast` /
`decode_batch`, which give the same ids and text. Pure-Python work (Jinja templates) still shares
the GIL, but the interpreter switches threads every few milliseconds, so the loop keeps answering.
"""
from __future__ import annotations

import asyncio
import functools
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, TypeVar

T = TypeVar("T")


def encode(tokenizer: Any, text: str, add_special_tokens: bool) -> list[int]:
    """`tokenizer.encode(text, add_special_tokens)` without holding the GIL while the Rust side runs."""
    raw = getattr(tokenizer, "_tok", None)
    batch = getattr(raw, "encode_batch_fast", None) or getattr(raw, "encode_batch", None)
    if batch is None:
        return tokenizer.encode(text, add_special_tokens=add_special_tokens)
    ids = batch([text], add_special_tokens=False)[0].ids
    bos = getattr(tokenizer, "bos_token_id", None)
    if add_special_tokens and getattr(tokenizer, "add_bos", False) and (not ids or ids[0] != bos):
        ids = [bos] + ids
    return ids


def decode(tokenizer: Any, ids: list[int], skip_special_tokens: bool = True) -> str:
    """`tokenizer.decode(ids)` without holding the GIL while the Rust side runs."""
    raw = getattr(tokenizer, "_tok", None)
    if raw is None or not hasattr(raw, "decode_batch"):
        return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    return raw.decode_batch([list(ids)], skip_special_tokens=skip_special_tokens)[0]


class CpuWork:
    """A bounded thread pool for request work; bounded so a burst of huge prompts queues here instead
    of taking every core from the engine thread."""

    def __init__(self, workers: int = 2):
        self.pool = ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="onecat-cpu")

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.pool, functools.partial(fn, *args, **kwargs))

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
