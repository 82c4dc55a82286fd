"""Per-step state the model's attention layers read (nano-vllm style): metadata, KV caches, backend."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from onecat.engine.attention.metadata import AttentionMetadata
    from onecat.engine.attention.selector import AttentionDispatcher
    from onecat.engine.cache.kv import LayerKVCache


@dataclass(slots=True)
class ForwardContext:
    meta: "AttentionMetadata"
    kv_caches: list["LayerKVCache"]
    attention: "AttentionDispatcher"
    gemv_rows: int = 1  # inputs of up to this many rows take the batch-1 GEMV (engine/layers/linear.py)
    # hybrid models: each sequence's recurrent-state slot (a CUDA graph's decode step: an int64 device tensor)
    state_slots: "list[int | None] | torch.Tensor | None" = None
    lookaheads: list[int] | None = None  # each sequence's draft tokens under verification (speculative decoding)
    # hybrid models, a CUDA graph's verify step: each row's padding tokens before its own (int64 device tensor)
    state_leads: "torch.Tensor | None" = None


_current: ForwardContext | None = None


def set_forward_context(ctx: ForwardContext | None) -> None:
    global _current
    _current = ctx


def gemv_row_limit() -> int:
    """How many input rows a projection may send through the batch-1 GEMV now: the step's limit (a
    speculative engine's batch-1 verify steps allow 1 + k), 1 outside a step."""
    return _current.gemv_rows if _current is not None else 1


def decode_step_sequences() -> int | None:
    """The sequences of the current step when each of them decodes (its query is its new token plus the drafts
    it verifies); None in a step with a prefill chunk, or outside a step. A layer whose kernel depends on its
    row count counts these instead, so that a verify step computes its rows as the decode step of the same
    batch does (quant/int4/linear.py)."""
    c = _current
    if c is None or c.lookaheads is None or c.meta.query_lens_cpu is None:
        return None
    qlens = c.meta.query_lens_cpu
    if len(qlens) != len(c.lookaheads) or any(q != 1 + d for q, d in zip(qlens, c.lookaheads)):
        return None
    return len(qlens)


def get_forward_context() -> ForwardContext:
    if _current is None:
        raise RuntimeError("model forward called outside an engine step (no forward context set)")
    return _current
