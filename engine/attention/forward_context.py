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
class PromptRows:
    """Which rows of a step's batch sit at prompt positions (a sequence's first num_prompt_tokens positions,
    whichever chunk or step computes them) and which do not (decoded tokens, drafts, a preempted sequence's
    recomputed output): layers whose prompt rows take another kernel (EngineArgs.cpu_prompt_matmul) split by it,
    as runs of consecutive rows (a sequence's rows are consecutive), so that each run is a view, not a gather."""

    step_rows: int  # the batch's rows: an input of another row count (the LM head's) is not split
    runs: tuple[tuple[int, int, bool], ...]  # (start, end, prompt?) covering 0..step_rows in order

    @property
    def all_prompt(self) -> bool:
        return len(self.runs) == 1 and self.runs[0][2]

    @classmethod
    def of(cls, rows: list[int] | None, step_rows: int) -> "PromptRows | None":
        """From the prompt rows' indices (ascending); None for a step without prompt rows."""
        if not rows:
            return None
        prompt = set(rows)
        runs, start = [], 0
        for r in range(1, step_rows + 1):
            if r == step_rows or (r in prompt) != (start in prompt):
                runs.append((start, r, start in prompt))
                start = r
        return cls(step_rows, tuple(runs))


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
    prompt_rows: PromptRows | None = None  # the step's rows at prompt positions (CPU steps)


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


def step_prompt_rows(rows: int) -> PromptRows | None:
    """The current step's prompt rows where an input of `rows` rows is its whole batch; None where the step has
    none, for any other input (the LM head's rows), and outside a step."""
    c = _current
    p = None if c is None else c.prompt_rows
    return p if p is not None and p.step_rows == rows else None


def get_forward_context() -> ForwardContext:
    if _current is None:
        raise RuntimeError("model forward called outside an engine step (no forward context set)")
    return _current
