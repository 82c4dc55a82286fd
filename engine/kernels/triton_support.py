"""Whether Triton can be used here, asked once; every Triton kernel module imports Triton lazily."""
from __future__ import annotations

import functools


@functools.lru_cache(maxsize=1)
def triton_unavailable_reason() -> str | None:
    try:
        import triton  # noqa: F401
    except Exception as e:  # ImportError, or a broken install
        return f"triton is not importable ({type(e).__name__}: {e})"
    return None
