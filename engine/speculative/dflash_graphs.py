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

Static inputs: block ids and positions [MAX_ROWS, block_size], context lengths [MAX_ROWS], and one
context K/V buffer [layers, 2, MAX_ROWS, capacity, nkv, hd] whose [:rows, :ctx] view each graph reads.
Each round copies the requests' cached context rows into it (a round with more rows or a longer
context than the buffer holds runs eagerly). Padding rows draft mask tokens at positions 0.. with an
empty context; rows past a request's length hold finite stale values that the length mask removes
(the buffer starts zeroed). Graphs are captured lazily, on the first round of each bucket.
"""
from __future__ import annotations

import os

import torch

from onecat.engine.speculative.dflash_cache import project_rows
from onecat.engine.transfers import to_device

ENV_FLAG = "ONECAT_DFLASH_CUDA_GRAPHS"
MAX_ROWS = 16
MAX_CONTEXT = 4096  # static context capacity (tokens) per row; the sliding window lowers it
ROW_SIZES = (1, 2, 4, 8, 16)
MIN_CONTEXT_BUCKET = 256
FLUSH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # feature rows a captured context projection takes


def graphs_wanted(device: torch.device, target_graphs: bool) -> bool:
    """`target_graphs`: the target runs full CUDA graphs (its cuda_graph setting)."""
    forced = os.environ.get(ENV_FLAG)
    return device.type == "cuda" and (forced == "1" if forced in ("0", "1") else target_graphs)


class DrafterGraphs:
    def __init__(self, drafter, embed: torch.nn.Module, cache, device: torch.device):
        self.drafter, self.embed, self.cache, self.device = drafter, embed, cache, device
        window = drafter.sliding_window
        self.capacity = min(MAX_CONTEXT, window) if window else MAX_CONTEXT
        self.row_sizes = [s for s in ROW_SIZES if s <= MAX_ROWS]
        self.ctx_sizes = []
        c = MIN_CONTEXT_BUCKET
        while c < self.capacity:
            self.ctx_sizes.append(c)
            c *= 2
        self.ctx_sizes.append(self.capacity)
        B = drafter.block_size
        layers, two, nkv, hd = cache.row_shape
        self.ids = torch.full((MAX_ROWS, B), drafter.mask_token_id, dtype=torch.long, device=device)
        self._block_offsets = torch.arange(B, device=device)
        self.pos = self._block_offsets.repeat(MAX_ROWS, 1)
        self.lens = torch.zeros(MAX_ROWS, dtype=torch.long, device=device)
        self.kv = torch.zeros(layers, two, MAX_ROWS, self.capacity, nkv, hd, dtype=cache.dtype, device=device)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None
        self.replays = 0
        self.disabled_reason: str | None = None
        feature_width = drafter.fc.in_features
        self.feats = torch.zeros(FLUSH_SIZES[-1], feature_width, dtype=cache.dtype, device=device)
        self.feat_pos = torch.zeros(FLUSH_SIZES[-1], dtype=torch.long, device=device)
        self.flush_graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.flush_replays = 0
        cache.projector = self.project

    def bucket(self, rows: int, ctx: int) -> tuple[int, int] | None:
        if self.disabled_reason is not None or rows > self.row_sizes[-1] or ctx > self.ctx_sizes[-1]:
            return None
        return (next(s for s in self.row_sizes if s >= rows), next(s for s in self.ctx_sizes if s >= ctx))

    def project(self, feats: torch.Tensor, pos: torch.Tensor) -> torch.Tensor | None:
        """The context projection of `feats` [n, L*H] at `pos` [n] by graph replay: [layers, 2, n, nkv, hd], a
        view of the graph's output (valid until its next replay), or None: project eagerly."""
        n = feats.shape[0]
        size = next((s for s in FLUSH_SIZES if s >= n), None)
        if size is None or self.disabled_reason is not None or self.device.type != "cuda":
            return None
        if size not in self.flush_graphs:
            captured = self._capture(lambda: project_rows(self.drafter, self.feats[:size], self.feat_pos[:size]))
            if captured is None:
                return None
            self.flush_graphs[size] = captured
        self.feats[:n].copy_(feats)
        self.feat_pos[:n].copy_(pos)
        graph, out = self.flush_graphs[size]
        graph.replay()
        self.flush_replays += 1
        return out[:, :, :n]

    def forward(self, rows: int, ctx: int) -> torch.Tensor:
        """The block forward over the static buffers' first `rows` rows and `ctx` context rows."""
        kv = self.kv[:, :, :rows, :ctx]
        layer_kv = [(kv[layer, 0], kv[layer, 1]) for layer in range(kv.shape[0])]
        return self.drafter.forward_cached(self.embed(self.ids[:rows]), self.pos[:rows], layer_kv, self.lens[:rows])

    def load(self, block: torch.Tensor, block_pos: torch.Tensor, request_ids: list[str], rows: int) -> None:
        """Write one round's inputs into the static buffers; rows R..rows-1 become padding."""
        R = block.shape[0]
        self.ids[:R].copy_(block)
        self.pos[:R].copy_(block_pos)
        self.lens[:R].copy_(to_device(self.cache.copy_into(request_ids, self.kv), self.device))
        if rows > R:
            self.ids[R:rows].fill_(self.drafter.mask_token_id)
            self.pos[R:rows].copy_(self._block_offsets.expand(rows - R, -1))
            self.lens[R:rows].zero_()

    def run(self, block: torch.Tensor, block_pos: torch.Tensor, request_ids: list[str],
            max_ctx: int) -> torch.Tensor | None:
        """[R, block_size, H] hidden states by graph replay, or None: run this round eagerly."""
        size = self.bucket(block.shape[0], max_ctx)
        if size is None or not self._ensure_captured(size):
            return None
        self.load(block, block_pos, request_ids, size[0])
        graph, out = self.graphs[size]
        graph.replay()
        self.replays += 1
        return out[:block.shape[0]]

    def _ensure_captured(self, size: tuple[int, int]) -> bool:
        if size not in self.graphs:
            captured = self._capture(lambda: self.forward(*size), size)
            if captured is not None:
                self.graphs[size] = captured
        return size in self.graphs

    def _capture(self, step, label=None) -> tuple[torch.cuda.CUDAGraph, torch.Tensor] | None:
        """(graph, output) of `step` over the static buffers, or None when capture failed (which turns the
        drafter's graphs off, not the round)."""
        try:
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                step()  # warm-up: kernels chosen and allocations settled outside the graph
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                out = step()
            if self.pool is None:
                self.pool = graph.pool()
            return graph, out
        except Exception as e:
            self.disabled_reason = f"capture failed for {label or 'the context projection'}: {type(e).__name__}: {e}"
            self.graphs.clear()
            self.flush_graphs.clear()
            torch.cuda.synchronize(self.device)
            return None

    def report(self) -> dict:
        return {"replays": self.replays, "captured": sorted(self.graphs), "capacity": self.capacity,
                "flush_replays": self.flush_replays, "flush_captured": sorted(self.flush_graphs),
                "disabled_reason": self.disabled_reason}
