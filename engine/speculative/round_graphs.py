"""What the drafters' CUDA graphs share (DFlash: dflash_graphs.py, MTP: mtp_graphs.py): a drafting round is a few
dozen small kernels whose launches, not their math, set its time on a GPU, so it replays a graph captured per
(rows bucket, context bucket[, ...]) over static buffers.

The requests' context keys/values (the drafter KV cache, dflash_cache.py) are copied each round into one static
buffer [layers, 2, MAX_ROWS, capacity, nkv, hd] whose [:rows, :ctx] view a graph reads, with each row's length
in a static [MAX_ROWS] tensor (a round with more rows or a longer context than the buffer holds runs eagerly).
Rows past a request's length hold finite stale values (the buffer starts zeroed) that the length mask removes.
Graphs are captured lazily, on the first round of each bucket (DFlash captures the buckets its engine can
reach at start-up, dflash_graphs.py); a capture that fails turns the drafter's graphs off (the round runs
eagerly) and says why. `captures` counts them: a step that captured is no sample of what a round costs.
"""
from __future__ import annotations

import torch

from onecat.engine.transfers import to_device

MAX_ROWS = 16
MAX_CONTEXT = 4096  # static context capacity (tokens) per row; a sliding window lowers it
ROW_SIZES = (1, 2, 4, 8, 16)
MIN_CONTEXT_BUCKET = 256


def open_graphs(make, what: str):
    """(graphs, None) from `make()`, or (None, why) when their static buffers do not fit in device memory: the
    drafter then drafts eagerly and says why."""
    try:
        return make(), None
    except torch.OutOfMemoryError as exc:
        return None, f"no memory for {what} context buffer ({exc})".split("\n")[0]


def describe_graphs(graphs: ContextGraphs | None, off_reason: str | None) -> dict:
    """A drafter's `describe()` entries for its graphs: on or not, their replays and captures, why they are off."""
    out: dict = {"cuda_graphs": graphs is not None}
    if graphs is not None:
        out["cuda_graph_replays"], out["cuda_graph_captures"] = graphs.replays, graphs.captures
    reason = off_reason or (graphs.disabled_reason if graphs is not None else None)
    if reason:
        out["cuda_graphs_off_reason"] = reason
    return out


class ContextGraphs:
    def __init__(self, cache, device: torch.device, window: int | None):
        self.cache, self.device = cache, device
        self.capacity = min(MAX_CONTEXT, window) if window else MAX_CONTEXT
        self.row_sizes = [s for s in ROW_SIZES if s <= MAX_ROWS]
        self.ctx_sizes = []
        c = MIN_CONTEXT_BUCKET
        while c < self.capacity:
            self.ctx_sizes.append(c)
            c *= 2
        self.ctx_sizes.append(self.capacity)
        layers, two, nkv, hd = cache.row_shape
        self.lens = torch.zeros(MAX_ROWS, dtype=torch.long, device=device)
        self.kv = torch.zeros(layers, two, MAX_ROWS, self.capacity, nkv, hd, dtype=cache.dtype, device=device)
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.capturing = device.type == "cuda"  # graphs are captured only on a GPU; elsewhere rounds run eagerly
        self.pool = None
        self.replays = 0
        self.captures = 0
        self.disabled_reason: str | None = None

    def bucket(self, rows: int, ctx: int) -> tuple[int, int] | None:
        """(rows bucket, context bucket) of a round, or None when it does not fit the static buffers."""
        if self.disabled_reason is not None or rows > self.row_sizes[-1] or ctx > self.ctx_sizes[-1]:
            return None
        return (next(s for s in self.row_sizes if s >= rows), next(s for s in self.ctx_sizes if s >= ctx))

    def load_context(self, request_ids: list[str], rows: int, padding_len: int = 0) -> None:
        """The requests' context rows into the static buffer, their lengths into `lens`; rows R..rows-1 are
        padding of length `padding_len` (a row that attends to nothing else needs one key)."""
        R = len(request_ids)
        self.lens[:R].copy_(to_device(self.cache.copy_into(request_ids, self.kv), self.device))
        if rows > R:
            self.lens[R:rows].fill_(padding_len)

    def context(self, rows: int, ctx: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per drafter layer, (keys, values) [rows, ctx, nkv, hd]: views of the static buffer."""
        kv = self.kv[:, :, :rows, :ctx]
        return [(kv[layer, 0], kv[layer, 1]) for layer in range(kv.shape[0])]

    def replay(self, key: tuple, step) -> torch.Tensor | None:
        """The output of the round's graph for `key` (captured from `step()` on first use), or None: run eagerly."""
        out = self.replay_in(self.graphs, key, step)
        if out is not None:
            self.replays += 1
        return out

    def replay_in(self, graphs: dict, key, step) -> torch.Tensor | None:
        """Replay the graph `graphs[key]`, capturing it from `step()` first if needed; its output, or None."""
        if not self.ensure(graphs, key, step):
            return None
        graph, out = graphs[key]
        graph.replay()
        return out

    def ensure(self, graphs: dict, key, step) -> bool:
        """`graphs[key]` captured from `step()` if it was not yet; False where graphs are off or capture failed."""
        if not self.capturing or self.disabled_reason is not None:
            return False
        if key not in graphs:
            captured = self.capture(step, key)
            if captured is None:
                return False
            graphs[key] = captured
            self.captures += 1
        return True

    def capture(self, step, label) -> tuple[torch.cuda.CUDAGraph, torch.Tensor] | None:
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
            self.disabled_reason = f"capture failed for {label}: {type(e).__name__}: {e}"
            self.forget_graphs()
            torch.cuda.synchronize(self.device)
            return None

    def forget_graphs(self) -> None:
        self.graphs.clear()

    def report(self) -> dict:
        return {"replays": self.replays, "captured": sorted(self.graphs), "capacity": self.capacity,
                "disabled_reason": self.disabled_reason}
