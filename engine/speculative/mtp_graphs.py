"""CUDA graphs for MTP drafting rounds: on where the target replays full CUDA graphs.

A round runs the head k times (per step: the layer input from the previous draft, q/k/v and gate, attention
over the kept context and the round's own rows, the MLP, the target's LM head and an argmax), some twenty
kernels a step whose launches, not their math, set the round's time on a GPU. One graph per (rows bucket,
context bucket, draft steps) replays the whole loop (the head's `draft`) over static buffers (round_graphs.py):
each request's newest kept features [MAX_ROWS, 2H] and position [MAX_ROWS] beside the shared context buffer.
Padding rows read zero features at position 0 over one stale context row (a row attending to nothing would
give NaN at the first step). A sampled request's drafts are keyed draws (core/keyed_draws.py): the round's keys
[MAX_ROWS, steps] are one more static buffer, and its rows' sampling settings (device constants, sampler.constant)
become part of the graph's key. Such a round is captured the second time its key is met, and at most
MAX_SAMPLED_GRAPHS of them are kept: batches whose settings keep changing draft eagerly rather than capture
graphs they never replay.
"""
from __future__ import annotations

import torch

from onecat.engine.core.keyed_draws import span_keys
from onecat.engine.core.sampler import constant, greedy_on_device, sample_on_device
from onecat.engine.core.sampler_graphs import draw_settings
from onecat.engine.sampling_params import SamplingParams
from onecat.engine.speculative.round_graphs import MAX_ROWS, ContextGraphs
from onecat.engine.transfers import to_device

MAX_SAMPLED_GRAPHS = 8  # graphs of rounds with sampled rows kept (their settings are in the key)
MAX_SEEN = 256  # sampled round keys remembered as met once; forgotten all at once past this


def keyed_pick(index: torch.Tensor, params: list[SamplingParams], keys: torch.Tensor):
    """The head's `pick` for a round with sampled rows: the argmax, and for rows `index` (a device index of the
    sampled rows) draft j drawn with keys[:, j] (keys [len(index), >= steps], the keys the target will draw those
    positions with). Called once per draft step, in order."""
    step = iter(range(keys.shape[1]))

    def pick(logits: torch.Tensor) -> torch.Tensor:
        token = greedy_on_device(logits)
        token[index] = sample_on_device(logits[index], params, keys[:, next(step)])
        return token

    return pick


class MTPGraphs(ContextGraphs):
    def __init__(self, head, embed, lm_head, cache, width: int, device: torch.device, max_steps: int = 16):
        super().__init__(cache, device, head.sliding_window)
        self.head, self.embed, self.lm_head = head, embed, lm_head
        self.feats = torch.zeros(MAX_ROWS, width, dtype=cache.dtype, device=device)
        self.pos = torch.zeros(MAX_ROWS, dtype=torch.long, device=device)
        self.keys = torch.zeros(MAX_ROWS, max_steps, dtype=torch.int64, device=device)  # sampled rows' draw keys
        self.seen: set[tuple] = set()  # sampled round keys met once (a second meeting captures)
        self.sampled_graphs = 0

    def forward(self, rows: int, ctx: int, steps: int,
                sampled: tuple[tuple[int, SamplingParams], ...] = ()) -> torch.Tensor:
        """Drafts [rows, steps] of the static buffers' first `rows` rows over `ctx` context rows: the argmax, or
        for each (row, settings) of `sampled` a draw keyed by the row's keys[row, j]."""
        (k_ctx, v_ctx), = self.context(rows, ctx)
        visible = torch.arange(ctx, device=self.device) < self.lens[:rows].unsqueeze(1)
        pick = greedy_on_device
        if sampled:
            index = constant([r for r, _ in sampled], self.device)
            pick = keyed_pick(index, [p for _, p in sampled], self.keys[index])
        return self.head.draft(self.embed, self.lm_head, self.head.context(self.feats[:rows]), self.pos[:rows],
                               k_ctx, v_ctx, visible, steps, pick)

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
            max_ctx: int, seqs=None, sampled: list[int] = ()) -> torch.Tensor | None:
        """Drafts [R, steps] by graph replay, or None: draft eagerly. `sampled`: the rows of `seqs` (the requests)
        that draw their drafts."""
        size = self.bucket(len(request_ids), max_ctx)
        if size is None or not self.capturing or steps > self.keys.shape[1]:
            return None
        rows = tuple((r, seqs[r].params) for r in sampled)
        key = (*size, steps, tuple((r, draw_settings(p)) for r, p in rows))
        if rows and key not in self.graphs:  # captured at the second meeting, up to MAX_SAMPLED_GRAPHS of them
            if key not in self.seen or self.sampled_graphs >= MAX_SAMPLED_GRAPHS:
                if len(self.seen) >= MAX_SEEN:
                    self.seen.clear()
                self.seen.add(key)
                return None
            self.sampled_graphs += 1
        self.load(request_ids, newest, last_positions, size[0])
        if rows:
            keys = span_keys([(seqs[r].seed, seqs[r].num_tokens, steps) for r in sampled], self.device)
            self.keys[constant(list(sampled), self.device), :steps] = keys.view(len(sampled), steps)
        out = self.replay(key, lambda: self.forward(*size, steps, rows))
        return None if out is None else out[:len(request_ids)]

    def forget_graphs(self) -> None:
        super().forget_graphs()
        self.sampled_graphs = 0
