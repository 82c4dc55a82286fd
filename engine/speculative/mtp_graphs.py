"""CUDA graphs for greedy MTP drafting rounds: on where the target replays full CUDA graphs.

A round runs the head k times (per step: the layer input from the previous draft, q/k/v and gate, attention
over the kept context and the round's own rows, the MLP, the target's LM head and an argmax), some twenty
kernels a step whose launches, not their math, set the round's time on a GPU. One graph per (rows bucket,
context bucket, draft steps) replays the whole loop (the head's `draft`) over static buffers (round_graphs.py):
each request's newest kept features [MAX_ROWS, 2H] and position [MAX_ROWS] beside the shared context buffer.
Padding rows read zero features at position 0 over one stale context row (a row attending to nothing would
give NaN at the first step). Rounds with a sampled request run eagerly: their draws come from each request's
own generator.
"""
from __future__ import annotations

import torch

from onecat.engine.speculative.round_graphs import MAX_ROWS, ContextGraphs
from onecat.engine.transfers import to_device


class MTPGraphs(ContextGraphs):
    def __init__(self, head, embed, lm_head, cache, width: int, device: torch.device):
        super().__init__(cache, device, head.sliding_window)
        self.head, self.embed, self.lm_head = head, embed, lm_head
        self.feats = torch.zeros(MAX_ROWS, width, dtype=cache.dtype, device=device)
        self.pos = torch.zeros(MAX_ROWS, dtype=torch.long, device=device)

    def forward(self, rows: int, ctx: int, steps: int) -> torch.Tensor:
        """Greedy drafts [rows, steps] of the static buffers' first `rows` rows over `ctx` context rows."""
        (k_ctx, v_ctx), = self.context(rows, ctx)
        visible = torch.arange(ctx, device=self.device) < self.lens[:rows].unsqueeze(1)
        return self.head.draft(self.embed, self.lm_head, self.head.context(self.feats[:rows]), self.pos[:rows],
                               k_ctx, v_ctx, visible, steps)

    def load(self, request_ids: list[str], newest: torch.Tensor, last_positions: list[int], rows: int) -> None:
        """One round's inputs into the static buffers; rows R..rows-1 become padding."""
        R = len(request_ids)
        self.feats[:R].copy_(newest)
        self.pos[:R].copy_(to_device(last_positions, self.device))
        self.load_context(request_ids, rows, padding_len=1)
        if rows > R:
            self.feats[R:rows].zero_()
            self.pos[R:rows].zero_()

    def run(self, request_ids: list[str], newest: torch.Tensor, last_positions: list[int], steps: int,
            max_ctx: int) -> torch.Tensor | None:
        """Greedy drafts [R, steps] by graph replay, or None: draft eagerly."""
        size = self.bucket(len(request_ids), max_ctx)
        if size is None or not self.capturing:
            return None
        self.load(request_ids, newest, last_positions, size[0])
        out = self.replay((*size, steps), lambda: self.forward(*size, steps))
        return None if out is None else out[:len(request_ids)]
