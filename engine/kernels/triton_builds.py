"""Triton kernels specialized in this process: each launch whose argument types, constexprs or specialization
(an integer equal to 1 or a multiple of 16, a pointer aligned to 16 bytes) the kernel has not met before builds a
new variant (compiled, or loaded from Triton's disk cache): 0.1-1.5 s of host time on the step that meets it. The
CUDA engine's warm-up builds the variants its requests select; one built later fell on a request. Counted through
Triton's cache-miss hook (chained to any hook set before), so a caller can see which kernels a run built and when:
`mark()` then `since(mark)`. Without Triton (CPU builds) nothing is counted."""
from __future__ import annotations

import threading
from collections import Counter

import torch

_lock = threading.Lock()
_built: list[str] = []  # "kernel(arg types and specializations)" of every variant built since install()
_installed = False


def install() -> bool:
    """Start counting (once per process); False where Triton or its hook is missing."""
    global _installed
    with _lock:
        if _installed:
            return True
        try:
            from triton import knobs
        except ImportError:
            return False
        runtime = getattr(knobs, "runtime", None)
        if runtime is None or not hasattr(runtime, "jit_cache_hook"):
            return False
        before = runtime.jit_cache_hook

        def hook(*args, repr: str = "", **kwargs):
            _built.append(repr)
            return before(*args, repr=repr, **kwargs) if before is not None else None

        runtime.jit_cache_hook = hook
        _installed = True
        return True


def mark() -> int:
    """A point to count from."""
    return len(_built)


def since(point: int) -> list[str]:
    """The variants built after `point` (a `mark()`), oldest first."""
    return list(_built[point:])


def describe(point: int) -> dict:
    """For records: how many variants were built after `point`, and how many of each kernel."""
    built = since(point)
    return {"count": len(built), "by_kernel": dict(Counter(b.split("[", 1)[0] for b in built))}


def aligned(t: torch.Tensor) -> torch.Tensor:
    """t itself where its data lies on a 16-byte boundary, else a contiguous copy (which does): Triton builds one
    variant of a kernel for aligned pointers and another for the rest, so a view that starts mid-tensor (a verify
    chunk's gates, a slice of logits rows) would build a variant the warm-up never met, on a request's step."""
    return t if t.data_ptr() % 16 == 0 else t.clone(memory_format=torch.contiguous_format)
