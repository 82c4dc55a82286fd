"""CUDA graphs for the DFlash drafter's round (its block forward and its context projection): on where the
target replays full CUDA graphs; ONECAT_DFLASH_CUDA_GRAPHS=0 or 1 overrides that (an A/B switch for measurements).

A drafting round is a few dozen small kernels (embedding, per layer: norms, projections, RoPE, two
score matmuls, softmax, MLP); on a GPU their launches, not their math, set its time. One graph per
(rows bucket, context bucket) replays the whole block forward: block ids -> target embeddings ->
drafter layers -> final norm, [rows, block_size, H]. The target's lm_head stays outside (each request
keeps only its first n drafts).

The round's context projection (dflash_cache.py `flush`: fc, hidden_norm, every layer's K/V projection, k_norm,
RoPE) replays a graph too, one per padded row count (FLUSH_SIZES; a longer flush, a prefill's, runs eagerly):
static feature rows and positions in, [layers, 2, rows, nkv, hd] out, of which the cache keeps the real rows.
Padding rows project whatever the static buffers held last (finite values at valid positions), never read.

The graphs a round of the engine's batch sizes and length limit can reach are captured when the drafter opens
(`capture_ahead`: rows buckets x context buckets, and the projection sizes); others on first use.

Static inputs (beyond the shared context buffer and lengths, round_graphs.py): block ids and positions
[MAX_ROWS, block_size]. Padding rows draft mask tokens at positions 0.. with an empty context (their block
gives them keys).
"""
from __future__ import annotations

import torch

from onecat.engine.speculative.dflash_cache import project_rows
from onecat.engine.speculative.round_graphs import MAX_ROWS, ContextGraphs
from onecat.engine.switches import switch

# the drafter's forward and context projection from CUDA graphs: unset where the target runs full graphs, 0 / 1 force
# it (A/B)
ENV_FLAG = "ONECAT_DFLASH_CUDA_GRAPHS"
FLUSH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # feature rows a captured context projection takes


def graphs_wanted(device: torch.device, target_graphs: bool) -> bool:
    """`target_graphs`: the target runs full CUDA graphs (its cuda_graph setting)."""
    forced = switch(ENV_FLAG, None)
    return device.type == "cuda" and (target_graphs if forced is None else forced)


class DrafterGraphs(ContextGraphs):
    def __init__(self, drafter, embed: torch.nn.Module, cache, device: torch.device):
        super().__init__(cache, device, drafter.sliding_window)
        self.drafter, self.embed = drafter, embed
        B = drafter.block_size
        self.ids = torch.full((MAX_ROWS, B), drafter.mask_token_id, dtype=torch.long, device=device)
        self._block_offsets = torch.arange(B, device=device)
        self.pos = self._block_offsets.repeat(MAX_ROWS, 1)
        self.feats = torch.zeros(FLUSH_SIZES[-1], drafter.fc.in_features, dtype=cache.dtype, device=device)
        self.feat_pos = torch.zeros(FLUSH_SIZES[-1], dtype=torch.long, device=device)
        self.flush_graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.flush_replays = 0
        cache.projector = self.project

    def project(self, feats: torch.Tensor, pos: torch.Tensor) -> torch.Tensor | None:
        """The context projection of `feats` [n, L*H] at `pos` [n] by graph replay: [layers, 2, n, nkv, hd], a
        view of the graph's output (valid until its next replay), or None: project eagerly."""
        n = feats.shape[0]
        size = next((s for s in FLUSH_SIZES if s >= n), None)
        if size is None or not self.capturing:
            return None
        self.feats[:n].copy_(feats)
        self.feat_pos[:n].copy_(pos)
        out = self.replay_in(self.flush_graphs, size, self._projection(size))
        if out is None:
            return None
        self.flush_replays += 1
        return out[:, :, :n]

    def _projection(self, size: int):
        """The context projection of the static feature rows' first `size`, as a step to capture."""
        return lambda: project_rows(self.drafter, self.feats[:size], self.feat_pos[:size])

    def forward(self, rows: int, ctx: int) -> torch.Tensor:
        """The block forward over the static buffers' first `rows` rows and `ctx` context rows."""
        return self.drafter.forward_cached(self.embed(self.ids[:rows]), self.pos[:rows], self.context(rows, ctx),
                                           self.lens[:rows])

    def load(self, block: torch.Tensor, block_pos: torch.Tensor, request_ids: list[str], rows: int) -> None:
        """Write one round's inputs into the static buffers; rows R..rows-1 become padding."""
        R = block.shape[0]
        self.ids[:R].copy_(block)
        self.pos[:R].copy_(block_pos)
        self.load_context(request_ids, rows)
        if rows > R:
            self.ids[R:rows].fill_(self.drafter.mask_token_id)
            self.pos[R:rows].copy_(self._block_offsets.expand(rows - R, -1))

    def run(self, block: torch.Tensor, block_pos: torch.Tensor, request_ids: list[str], max_ctx: int,
            extra: list[torch.Tensor] | None = None, lens: torch.Tensor | None = None) -> torch.Tensor | None:
        """[R, block_size, H] hidden states by graph replay, or None: run this round eagerly. A round drafted
        before its context lengths reach the host (draft_ahead.py) brings each request's `extra` projected rows
        [layers, 2, n, nkv, hd], placed behind its held context, and the lengths `lens` [R] on the device."""
        size = self.bucket(block.shape[0], max_ctx)
        if size is None or not self.capturing:
            return None
        self.load(block, block_pos, request_ids, size[0])
        if extra is not None:
            for r, (n, e) in enumerate(zip(self.cache.lengths(request_ids), extra)):
                self.kv[:, :, r, n:n + e.shape[2]].copy_(e)
            self.lens[:len(request_ids)].copy_(lens)
        out = self.replay(size, lambda: self.forward(*size))
        return None if out is None else out[:block.shape[0]]

    def capture_ahead(self, max_rows: int, max_ctx: int) -> int:
        """Capture every block-forward graph a round of up to `max_rows` requests over up to `max_ctx` context
        rows can replay, and every context projection size, now (at start-up) rather than inside a decode step,
        where each capture costs milliseconds and the gate would time it as a round. Returns how many."""
        last = self.bucket(min(max_rows, self.row_sizes[-1]), min(max_ctx, self.ctx_sizes[-1]))
        if last is None or not self.capturing:
            return 0
        before = self.captures
        for rows in (r for r in self.row_sizes if r <= last[0]):
            for ctx in (c for c in self.ctx_sizes if c <= last[1]):
                self.ensure(self.graphs, (rows, ctx), lambda rows=rows, ctx=ctx: self.forward(rows, ctx))
        for size in FLUSH_SIZES:
            self.ensure(self.flush_graphs, size, self._projection(size))
        return self.captures - before

    def forget_graphs(self) -> None:
        super().forget_graphs()
        self.flush_graphs.clear()

    def report(self) -> dict:
        return {**super().report(), "flush_replays": self.flush_replays, "flush_captured": sorted(self.flush_graphs)}
