"""Full-decode CUDA graphs: capture the whole forward + logits for a set of padded batch sizes, replay.

A pure decode step (every sequence adds one token, no draft tokens, no prompt logprobs) with B
sequences replays the graph captured for the smallest size >= B. Padded rows read token 0 at
position 0, attend to one slot of the null block 0 and write their K/V there: block 0 is never
handed out and every backend masks it out past a sequence's length, so the values are harmless.
Inputs travel in one pinned host buffer and one copy per step. Graphs are captured lazily, on the
first step of each size, with all rows pointed at the null block, so capture never touches live KV.
Capture needs a backend whose decode calls are graph-safe (no host syncs, launches sized from
shapes); otherwise graphs stay off and the reason is reported.
"""
from __future__ import annotations

import torch

from onecat.engine.attention.metadata import AttentionMetadata
from onecat.engine.forward_context import ForwardContext, set_forward_context

_SIZES = (1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256)


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, kv_caches, attention, block_size: int, device: torch.device,
                 max_model_len: int, max_num_seqs: int):
        self.model, self.kv_caches, self.attention = model, kv_caches, attention
        self.block_size, self.device, self.max_model_len = block_size, device, max_model_len
        self.sizes = [s for s in _SIZES if s < max_num_seqs] + [max_num_seqs]
        self.max_blocks = -(-max_model_len // block_size)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None
        self.disabled_reason: str | None = None
        if not getattr(attention.primary, "graph_safe", False):
            self.disabled_reason = f"attention backend {attention.primary.name} is not graph-safe"
        self.replays = 0
        self._bufs = None

    # ---- static buffers ---------------------------------------------------------------------------
    def _buffers(self):
        if self._bufs is None:
            n, w = self.sizes[-1], self.max_blocks
            # one int64 host row per field: ids, positions, slots, seq_lens, then the block table
            host = torch.zeros(4 * n + n * w, dtype=torch.int64, pin_memory=True)
            dev = torch.zeros_like(host, device=self.device)
            self._bufs = (host, dev, torch.cuda.Event())
            self._bufs[2].record()
        return self._bufs

    def _views(self, dev: torch.Tensor, size: int):
        n, w = self.sizes[-1], self.max_blocks
        ids, pos, slots, lens = (dev[i * n:i * n + size] for i in range(4))
        tables = dev[4 * n:].view(n, w)[:size]
        return ids, pos, slots, lens, tables

    def _forward(self, size: int, int32: dict) -> torch.Tensor:
        _, dev, _ = self._buffers()
        ids, pos, slots, _, _ = self._views(dev, size)
        meta = AttentionMetadata(
            query_start_loc=int32["qsl"][:size + 1], seq_lens=int32["lens"][:size],
            block_tables=int32["tables"][:size], slot_mapping=slots, max_query_len=1,
            max_seq_len=self.max_model_len, block_size=self.block_size, query_lens_cpu=[1] * size,
            seq_lens_cpu=[self.max_model_len] * size, extras={})
        set_forward_context(ForwardContext(meta, self.kv_caches, self.attention))
        try:
            hidden = self.model(ids, pos)
        finally:
            set_forward_context(None)
        return self.model.compute_logits(hidden)

    def _int32_views(self, size: int) -> dict:
        """int32 copies the attention metadata wants, refreshed from the int64 buffer inside the graph."""
        if not hasattr(self, "_i32"):
            n, w = self.sizes[-1], self.max_blocks
            self._i32 = {"lens": torch.ones(n, dtype=torch.int32, device=self.device),
                         "tables": torch.zeros(n, w, dtype=torch.int32, device=self.device),
                         "qsl": torch.arange(n + 1, dtype=torch.int32, device=self.device)}
        return self._i32

    def _step(self, size: int) -> torch.Tensor:
        _, dev, _ = self._buffers()
        i32 = self._int32_views(size)
        _, _, _, lens, tables = self._views(dev, size)
        i32["lens"][:size].copy_(lens)
        i32["tables"][:size].copy_(tables)
        return self._forward(size, i32)

    def _capture(self, size: int) -> None:
        host, dev, ready = self._buffers()
        ready.synchronize()
        host.zero_()
        n = self.sizes[-1]
        host[3 * n:4 * n] = 1  # every row: one token of context, slot 0 of the null block
        dev.copy_(host)
        calls_before = dict(self.attention.calls)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self._step(size)  # warm-up: compiles kernels and settles allocations outside the graph
        torch.cuda.current_stream(self.device).wait_stream(side)
        used = {k: v - calls_before.get(k, 0) for k, v in self.attention.calls.items()}
        if set(k for k, v in used.items() if v) != {self.attention.primary.name}:
            self.disabled_reason = f"attention fell back during capture: {self.attention.fallback_reasons}"
            return
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = self._step(size)
        if self.pool is None:
            self.pool = graph.pool()
        self.graphs[size] = (graph, logits)

    # ---- the step ---------------------------------------------------------------------------------
    def eligible(self, sched) -> int | None:
        """The graph size for this step, or None when it must run eagerly."""
        if self.disabled_reason is not None or len(sched) > self.sizes[-1]:
            return None
        if getattr(self.model, "aux_layer_ids", None):  # a drafter reads per-step hidden states: stay eager
            return None
        for s in sched:
            seq = s.seq
            if s.num_new_tokens != 1 or s.num_lookahead or seq.num_computed_tokens + 1 != seq.num_tokens:
                return None
            if seq.prompt_logprobs is not None and seq.num_computed_tokens < seq.num_prompt_tokens:
                return None
        return next(size for size in self.sizes if size >= len(sched))

    def run(self, sched) -> torch.Tensor | None:
        """Logits [B, V] (float32) for a pure decode step, or None to run it eagerly."""
        size = self.eligible(sched)
        if size is None:
            return None
        rows = [(s.seq, s.seq.num_computed_tokens) for s in sched]
        logits = self.replay(rows, size, None)
        return None if logits is None else logits.float()

    def ensure_captured(self, size: int) -> bool:
        if size not in self.graphs:
            try:
                self._capture(size)
            except Exception as e:  # a capture failure turns graphs off for the engine, not the step
                self.disabled_reason = f"capture failed for batch {size}: {type(e).__name__}: {e}"
                self.graphs.clear()
                torch.cuda.synchronize(self.device)
        return size in self.graphs

    def replay(self, rows: list, size: int, ids_dev: torch.Tensor | None) -> torch.Tensor | None:
        """One decode step for `rows` = [(seq, position)]: the token at `position` goes in (from the
        sequence, or row i of `ids_dev` when given: a previous step's output still on the device).
        Returns the [len(rows), V] logits (a view of the graph's output buffer), or None."""
        if not self.ensure_captured(size):
            return None
        host, dev, ready = self._buffers()
        ready.synchronize()  # the previous step's copy has left the pinned buffer
        n, w, bs = self.sizes[-1], self.max_blocks, self.block_size
        arr = host.numpy()
        fields = arr[:4 * n].reshape(4, n)  # ids, positions, slots, seq_lens
        tables = arr[4 * n:].reshape(n, w)
        fields[:, :size] = 0
        fields[3, :size] = 1
        tables[:size] = 0
        for i, (seq, p) in enumerate(rows):
            table = seq.block_table
            if ids_dev is None:
                fields[0, i] = seq.token_ids[p]
            fields[1, i] = p
            fields[2, i] = table[p // bs] * bs + p % bs
            fields[3, i] = p + 1
            tables[i, :len(table)] = table
        dev[:4 * n].copy_(host[:4 * n], non_blocking=True)
        dev[4 * n:4 * n + size * w].copy_(host[4 * n:4 * n + size * w], non_blocking=True)
        ready.record()
        if ids_dev is not None:
            dev[:len(rows)].copy_(ids_dev[:len(rows)])
        graph, logits = self.graphs[size]
        graph.replay()
        self.replays += 1
        return logits[:len(rows)]

    def report(self) -> dict:
        return {"used": self.replays > 0, "replays": self.replays, "captured_sizes": sorted(self.graphs),
                "disabled_reason": self.disabled_reason}
