"""Full-step CUDA graphs: capture the whole forward + logits for a set of padded batch sizes, replay.

Two step shapes replay: a pure decode step (every sequence adds one token) and a speculative verify
step of q query tokens a row (q: 2, 4, 8, ... up to 1 + k, k the engine's drafts per round; a step takes
the narrowest width its longest draft fits, `verify_widths`). In a verify step each sequence brings its last
token and d <= q - 1 drafts (drafts of any length: n-gram lookups that found fewer, adaptive k, a request's
draft length, a budget cut by max_tokens or max_model_len; d = 0 for a sequence with no draft, whose row is
then a plain sample): its d + 1 tokens sit at the END of its row of q (`verify_lead` padding tokens first). A
padding token reads the sequence's own KV up to an earlier position (its context length is clamped to at
least 1), writes its K/V into the null block, and its logits are never read, so the real tokens see
exactly what an eager step of d + 1 tokens shows them. A step with B sequences replays the graph
captured for (the smallest size >= B, q); any other step (prefill, prompt logprobs) runs eagerly.
Padded rows read token 0 at positions 0..q-1, attend to slots of the null block 0 and write their K/V
there: block 0 is never handed out and every backend masks it out past a sequence's length, so the
values are harmless. Inputs travel in one pinned host buffer per q and one copy per step. Graphs are
captured lazily, on the first step of each shape, with all rows pointed at the null block, so capture
never touches live KV. Capture needs a backend whose calls are graph-safe (no host syncs, launches
sized from shapes; for verify steps it also takes its per-token work items from the graph's static
buffers); otherwise graphs stay off (or verify steps stay eager) and the reason is reported.
When a block drafter taps hidden states (`aux_layer_ids`), the graph keeps them as an output too and
each replay hands a copy to the model's `aux_hidden`, as an eager forward would.
A hybrid model (a recurrent-state cache, engine/cache/recurrent_state.py) replays its decode and verify steps too:
each row's state slot travels in the same buffer (padded rows: the cache's scratch slot), and for a verify step
each row's padding count (`verify_lead`), the model takes its step's plan from those device tensors, and the
layers update the state rows of those slots inside the cache's tensors (a verify row runs the request's own
tokens from its slot's state and keeps what a rollback recomputes from). The host-side part of such a step
(zeroing the slot of a request at position 0, rolling a slot back after rejected drafts) runs before the
replay.
Under tensor parallelism every rank holds the same graphs: rank 0 describes each replay as a
`GraphStep` (plain lists) and sends it to the other ranks, which capture (on first use) and replay
the same graph with it; the layers' collectives are inside the graphs.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from onecat.engine.attention.forward_context import ForwardContext, set_forward_context
from onecat.engine.attention.metadata import AttentionMetadata
from onecat.engine.switches import switch
from onecat.engine.transfers import to_device

NARROW_VERIFY_MAX_SIZE = 32  # verify graphs of narrower widths than 1 + k up to this batch size
# a hybrid model's narrower verify graphs (rows of width q < 1 + k on trail buffers of width 1 + k): read once; their
# GPU test (tests/test_hybrid_gpu.py) passed on an H100 and route 1 at batch 1 went from 1.762x to 2.214x target-only
# with them (benchmarks/results/seed_route_h100_b1_narrow_{0,1}.json); ONECAT_HYBRID_NARROW_VERIFY=0 turns them off
HYBRID_NARROW_VERIFY = switch("ONECAT_HYBRID_NARROW_VERIFY", True)


@dataclass(slots=True)
class GraphStep:
    """One replay as plain lists: what every tensor-parallel rank needs to replay it."""

    size: int  # the captured batch size replayed
    q: int  # query tokens per row (1: decode)
    ids: list[int] | None  # per row its token then its q - 1 drafts; None: row tokens come from the device
    starts: list[int]  # per row, the position of its first query token
    tables: list[list[int]]  # per row, its block table
    gemv_rows: int  # rows that take the batch-1 GEMV (fixed at capture; rank 0's value)
    state_slots: list[int] | None = None  # hybrid models: per row, its recurrent-state slot
    drafts: list[int] | None = None  # verify steps: per row, its drafts (<= q - 1); None: q - 1 each
    # verify steps whose drafts stayed on the device: per row its draft tensor (`ids` holds 0 in their place);
    # never sent to other ranks (a tensor-parallel engine drafts to host lists)
    device_drafts: list[torch.Tensor] | None = None


def verify_lead(q: int, drafts: int) -> int:
    """Padding tokens before a row's own tokens in a verify graph of q tokens a row (its token + drafts)."""
    if not 0 <= drafts <= q - 1:
        raise ValueError(f"{drafts} drafts do not fit a verify row of {q} tokens")
    return q - 1 - drafts


def real_rows(q: int, drafts: list[int]) -> list[int]:
    """Indices, in a verify graph's [rows * q] outputs, of the rows' own tokens (padding left out)."""
    return [i * q + j for i, d in enumerate(drafts) for j in range(verify_lead(q, d), q)]


_SIZES = (1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256)


def _write_device_drafts(ids: torch.Tensor, drafts: list[torch.Tensor | None]) -> None:
    """Put device-held drafts at the end of their verify rows (`ids` [rows, q], on the device): one copy when
    every row has as many, else one per row; rows with None keep what the host wrote."""
    lens = {None if d is None else d.shape[0] for d in drafts}
    if len(lens) == 1 and None not in lens:
        n = lens.pop()
        if n:
            ids[:, ids.shape[1] - n:].copy_(torch.stack(drafts))
        return
    for row, d in zip(ids, drafts):
        if d is not None and d.shape[0]:
            row[row.shape[0] - d.shape[0]:].copy_(d)


def fill_rows(step: GraphStep, pos, slots, lens, tables, block_size: int) -> None:
    """Write the step's rows into the host buffer's fields (numpy views; padded graph rows already set): per
    row its positions, KV slots, length and block table. A verify row of d < q - 1 drafts starts with
    `verify_lead` padding tokens: positions just before the row's own (never below 0), slots in the null
    block; the row's length is its own, so each real token's context is exactly an eager step's."""
    q, bs = step.q, block_size
    for i, (p, table) in enumerate(zip(step.starts, step.tables)):
        at = i * q
        lead = verify_lead(q, step.drafts[i]) if q > 1 else 0
        for j in range(q):
            if j < lead:
                pos[at + j] = max(0, p - lead + j)
                slots[at + j] = j % bs  # the null block
                continue
            t = p + j - lead
            pos[at + j] = t
            slots[at + j] = table[t // bs] * bs + t % bs
        lens[i] = p + q - lead
        tables[i, :len(table)] = table


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, kv_caches, attention, block_size: int, device: torch.device,
                 max_model_len: int, max_num_seqs: int):
        self.model, self.kv_caches, self.attention = model, kv_caches, attention
        self.block_size, self.device, self.max_model_len = block_size, device, max_model_len
        self.sizes = [s for s in _SIZES if s < max_num_seqs] + [max_num_seqs]
        self.max_blocks = -(-max_model_len // block_size)
        # (size, q, tapped layers) -> (graph, logits [size * q, V], tapped hidden states or None)
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor | None]] = {}
        self.pool = None
        self.disabled_reason: str | None = None
        self.verify_disabled_reason: str | None = None
        self.verify_query_len: int | None = None  # 1 + drafts per round, set by the engine that verifies
        self.narrow_verify = False  # also narrower verify widths (a proposer whose requests draft fewer)
        self.verify_gemv_rows = 1  # rows of a verify step that take the batch-1 GEMV (ModelRunner.setup_verify)
        self.states = getattr(model, "states", None)  # a hybrid model's recurrent-state cache
        if not getattr(attention.primary, "graph_safe", False):
            self.disabled_reason = f"attention backend {attention.primary.name} is not graph-safe"
        elif not getattr(attention.primary, "graph_safe_verify", False):
            self.verify_disabled_reason = f"attention backend {attention.primary.name} has no graph-safe verify path"
        self.replays = 0
        self.verify_replays = 0
        # graphs captured so far (a dropped graph captured again counts again) and the wall seconds they took: a
        # capture runs inside the step that first needs its shape, so a benchmark can tell one fell in its timing
        self.captures = 0
        self.capture_s = 0.0
        self._bufs: dict[int, tuple] = {}
        self._i32: dict[int, dict] = {}

    # ---- static buffers (one set per query length q) ------------------------------------------------
    def _buffers(self, q: int):
        if q not in self._bufs:
            n, w = self.sizes[-1], self.max_blocks
            # int64 host fields: ids, positions, slots (n * q each), seq_lens (n), recurrent-state slots (n), each
            # verify row's padding tokens (n), then the block table
            host = torch.zeros(3 * n * q + 3 * n + n * w, dtype=torch.int64, pin_memory=True)
            dev = torch.zeros_like(host, device=self.device)
            ready = torch.cuda.Event()
            ready.record()
            self._bufs[q] = (host, dev, ready)
        return self._bufs[q]

    def _views(self, dev: torch.Tensor, q: int, size: int):
        n, w = self.sizes[-1], self.max_blocks
        t, T = size * q, n * q
        ids, pos, slots = dev[:t], dev[T:T + t], dev[2 * T:2 * T + t]
        lens = dev[3 * T:3 * T + size]
        states = dev[3 * T + n:3 * T + n + size]
        leads = dev[3 * T + 2 * n:3 * T + 2 * n + size]
        tables = dev[3 * T + 3 * n:].view(n, w)[:size]
        return ids, pos, slots, lens, states, leads, tables

    def _int32_views(self, q: int) -> dict:
        """int32 copies the attention metadata wants, refreshed from the int64 buffer inside the graph;
        for q > 1 also the per-token work items (token, its sequence, its causal context length)."""
        if q not in self._i32:
            n, w, dev = self.sizes[-1], self.max_blocks, self.device
            i32 = {"lens": torch.full((n,), q, dtype=torch.int32, device=dev),
                   "tables": torch.zeros(n, w, dtype=torch.int32, device=dev),
                   "qsl": torch.arange(n + 1, dtype=torch.int32, device=dev) * q}
            if q > 1:
                i32["tok"] = torch.arange(n * q, dtype=torch.int32, device=dev)
                i32["row"] = i32["tok"] // q
                i32["offset"] = torch.arange(q, dtype=torch.int32, device=dev) - (q - 1)
                i32["ctx"] = torch.ones(n * q, dtype=torch.int32, device=dev)
            self._i32[q] = i32
        return self._i32[q]

    def _step(self, size: int, q: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        _, dev, _ = self._buffers(q)
        i32 = self._int32_views(q)
        ids, pos, slots, lens, states, leads, tables = self._views(dev, q, size)
        i32["lens"][:size].copy_(lens)
        i32["tables"][:size].copy_(tables)
        meta = AttentionMetadata(
            query_start_loc=i32["qsl"][:size + 1], seq_lens=i32["lens"][:size], block_tables=i32["tables"][:size],
            slot_mapping=slots, max_query_len=q, max_seq_len=self.max_model_len, block_size=self.block_size,
            query_lens_cpu=[q] * size, seq_lens_cpu=[self.max_model_len] * size, extras={})
        if q > 1:  # token j of a row sees its sequence's context up to itself: seq_len - (q - 1) + j
            t = size * q
            # (a padding token at the front of a short row would get <= 0: it reads position 0 instead)
            i32["ctx"][:t].view(size, q).copy_((i32["lens"][:size, None] + i32["offset"]).clamp_(min=1))
            self.attention.primary.verify_layout(meta, i32["tok"][:t], i32["row"][:t], i32["ctx"][:t],
                                                 self.max_model_len)
        gemv_rows = self.verify_gemv_rows if size == 1 else 1  # a batch-1 verify step: rows as in batch-1 decode
        hybrid = self.states is not None
        set_forward_context(ForwardContext(meta, self.kv_caches, self.attention, gemv_rows,
                                           states if hybrid else None, state_leads=leads if hybrid and q > 1 else None))
        try:
            hidden = self.model(ids, pos)
            return self.model.compute_logits(hidden), getattr(self.model, "aux_hidden", None)
        finally:
            set_forward_context(None)

    def verify_widths(self, size: int = 1) -> list[int]:
        """The query lengths verify graphs of batch size `size` are captured for: 1 + k, and where the proposer's
        requests draft fewer by their acceptance (`narrow_verify`, speculative/draft_length.py) also 2, 4, 8, ...
        below it, so that such rounds verify fewer rows. Above NARROW_VERIFY_MAX_SIZE sequences only 1 + k (each
        graph keeps its logits, size x q rows of the vocabulary). A hybrid model's narrower rows (with
        HYBRID_NARROW_VERIFY) use the same recurrent-state trail buffers (reserved at 1 + k before any capture,
        ModelRunner.setup_verify; a row of width q keeps its inputs in their first q places, as an eager verify
        chunk does)."""
        top = self.verify_query_len
        if not self.narrow_verify or size > NARROW_VERIFY_MAX_SIZE or (self.states is not None
                                                                         and not HYBRID_NARROW_VERIFY):
            return [top]
        return [w for w in (2, 4, 8, 16, 32) if w < top] + [top]

    def _key(self, size: int, q: int) -> tuple:
        return size, q, tuple(getattr(self.model, "aux_layer_ids", None) or ())

    def _capture(self, size: int, q: int) -> None:
        start = time.perf_counter()
        try:
            self._capture_graph(size, q)
        finally:
            self.captures += 1
            self.capture_s += time.perf_counter() - start

    def _capture_graph(self, size: int, q: int) -> None:
        host, dev, ready = self._buffers(q)
        ready.synchronize()
        host.zero_()
        n, T = self.sizes[-1], self.sizes[-1] * q
        host[T:2 * T] = torch.arange(q).repeat(n)  # every row: q tokens at positions 0..q-1 of the null block
        host[2 * T:3 * T] = torch.arange(q).repeat(n) % self.block_size
        host[3 * T:3 * T + n] = q
        if self.states is not None:  # capture never touches a request's recurrent state
            host[3 * T + n:3 * T + 2 * n] = self.states.scratch_slot
        dev.copy_(host)
        calls_before = dict(self.attention.calls)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self._step(size, q)  # warm-up: compiles kernels and settles allocations outside the graph
        torch.cuda.current_stream(self.device).wait_stream(side)
        used = {k: v - calls_before.get(k, 0) for k, v in self.attention.calls.items()}
        if set(k for k, v in used.items() if v) != {self.attention.primary.name}:
            self._disable(q, f"attention fell back during capture: {self.attention.fallback_reasons}")
            return
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits, aux = self._step(size, q)
        if self.pool is None:
            self.pool = graph.pool()
        self.graphs[self._key(size, q)] = (graph, logits, aux)

    def _disable(self, q: int, reason: str) -> None:
        if q == 1:
            self.disabled_reason = reason
        else:
            self.verify_disabled_reason = reason

    # ---- the step ---------------------------------------------------------------------------------
    def eligible(self, sched) -> tuple[int, int] | None:
        """(graph size, query length q) for this step, or None when it must run eagerly."""
        if self.disabled_reason is not None or not sched or len(sched) > self.sizes[-1]:
            return None
        size = next(size for size in self.sizes if size >= len(sched))
        most = max(s.num_lookahead for s in sched)
        q = 1  # pure decode, or the narrowest verify width the step's longest draft fits
        if most:
            if self.verify_disabled_reason is not None or self.verify_query_len is None \
                    or most + 1 > self.verify_query_len:
                return None
            q = next(w for w in self.verify_widths(size) if w >= most + 1)
        for s in sched:
            seq = s.seq
            if s.num_new_tokens != 1 or seq.num_computed_tokens + 1 != seq.num_tokens:
                return None
            if seq.prompt_logprobs is not None and seq.num_computed_tokens < seq.num_prompt_tokens:
                return None
        return size, q

    def run(self, sched, announce=None) -> tuple[torch.Tensor, int] | None:
        """(logits [B * q, V] float32, q) for a pure decode (q = 1) or verify step, or None to run it
        eagerly. Row i * q + j is sequence i's j-th query token; in a verify step sequence i's own tokens
        are its last 1 + num_lookahead rows (`verify_lead`). `announce(kind, payload)` tells
        the other tensor-parallel ranks first: "capture" (size, q, GEMV rows) before a graph's first use,
        so every rank captures at once and, when capture fails (on all alike), all run the step eagerly;
        then "graph" with the GraphStep to replay."""
        shape = self.eligible(sched)
        if shape is None:
            return None
        size, q = shape
        drafts = [s.num_lookahead for s in sched] if q > 1 else None
        step = self.graph_step([(s.seq, s.seq.num_computed_tokens) for s in sched], size, q, drafts=drafts)
        if announce is not None:
            if step.device_drafts is not None:  # proposers of a tensor-parallel engine draft to host lists
                raise RuntimeError("a verify step's drafts are on rank 0's device; other ranks cannot read them")
            if self._key(size, q) not in self.graphs:
                announce("capture", (size, q, self.verify_gemv_rows))
                if not self.ensure_captured(size, q):
                    return None
            announce("graph", step)
        logits = self.replay_step(step)
        return None if logits is None else (logits.float(), q)

    # Every graph buffer is made and written in inference mode, whoever calls (the step runs in it, the
    # start-up warm-up and the decode pipeline do not): an inference tensor written outside it fails.
    @torch.inference_mode()
    def ensure_captured(self, size: int, q: int = 1) -> bool:
        if self._key(size, q) not in self.graphs:
            try:
                self._capture(size, q)
            except Exception as e:  # a capture failure turns graphs off for the engine, not the step
                self._disable(q, f"capture failed for batch {size}, {q} tokens each: {type(e).__name__}: {e}")
                if q == 1:
                    self.graphs.clear()
                torch.cuda.synchronize(self.device)
        return self._key(size, q) in self.graphs

    def graph_step(self, rows: list, size: int, q: int = 1, with_ids: bool = True,
                   drafts: list[int] | None = None) -> GraphStep:
        """The replay of `rows` = [(seq, position)] at graph size `size`: the token at `position` (unless
        `with_ids` is False: the caller passes them on the device), then, when q > 1, the sequence's
        first drafts[i] draft tokens (q - 1 each when `drafts` is None), behind `verify_lead` padding."""
        if q > 1 and drafts is None:
            drafts = [q - 1] * len(rows)
        ids, on_device = None, None
        if with_ids:
            ids = []
            for i, (seq, p) in enumerate(rows):
                if q > 1:
                    ids.extend([0] * verify_lead(q, drafts[i]))
                ids.append(seq.token_ids[p])
                if q > 1:
                    own = seq.draft_tokens[:drafts[i]]
                    if isinstance(own, torch.Tensor):
                        on_device = on_device or [None] * len(rows)
                        on_device[i] = own
                        own = [0] * drafts[i]
                    ids.extend(own)
        state_slots = [seq.state_slot for seq, _ in rows] if self.states is not None else None
        # the tables by reference: read at once (or pickled for TP)
        return GraphStep(size, q, ids, [p for _, p in rows], [seq.block_table for seq, _ in rows],
                         self.verify_gemv_rows, state_slots, drafts, on_device)

    def replay(self, rows: list, size: int, ids_dev: torch.Tensor | None, q: int = 1) -> torch.Tensor | None:
        """One step for `rows` = [(seq, position)]; row tokens from the sequences, or row i of `ids_dev`
        when given (a previous step's output still on the device). See replay_step."""
        return self.replay_step(self.graph_step(rows, size, q, with_ids=ids_dev is None), ids_dev)

    @torch.inference_mode()
    def replay_step(self, step: GraphStep, ids_dev: torch.Tensor | None = None) -> torch.Tensor | None:
        """Replay (capturing first if needed) the graph for `step`. Returns the [rows * q, V] logits (a
        view of the graph's output buffer), or None; a tapping model's `aux_hidden` gets a copy of the
        tapped rows."""
        size, q = step.size, step.q
        self.verify_gemv_rows = step.gemv_rows  # a worker rank captures with rank 0's value
        if not self.ensure_captured(size, q):
            return None
        host, dev, ready = self._buffers(q)
        ready.synchronize()  # the previous step's copy has left the pinned buffer
        n, w, bs = self.sizes[-1], self.max_blocks, self.block_size
        T = n * q
        arr = host.numpy()
        ids, pos, slots = arr[:T], arr[T:2 * T], arr[2 * T:3 * T]
        lens = arr[3 * T:3 * T + n]
        states = arr[3 * T + n:3 * T + 2 * n]
        leads = arr[3 * T + 2 * n:3 * T + 3 * n]
        tables = arr[3 * T + 3 * n:].reshape(n, w)
        for f in (ids, pos, slots):
            f[:size * q] = 0
        pos[:size * q] = list(range(q)) * size  # padded rows: the null block, as at capture
        slots[:size * q] = [j % bs for j in range(q)] * size
        lens[:size] = q
        tables[:size] = 0
        rows = len(step.starts)
        if self.states is not None:  # padded rows: the scratch slot, as at capture
            # the step's host side first (zero / roll back slots, count positions), queued before the replay
            if q == 1:
                self.states.prepare_decode(step.state_slots, [p + 1 for p in step.starts])
            else:
                own = [d + 1 for d in step.drafts]
                self.states.prepare_verify(step.state_slots, [p + m for p, m in zip(step.starts, own)], own, q)
                leads[:size] = 0
                leads[:rows] = [verify_lead(q, d) for d in step.drafts]
            states[:size] = self.states.scratch_slot
            states[:rows] = step.state_slots
        if step.ids is not None:
            ids[:rows * q] = step.ids
        fill_rows(step, pos, slots, lens, tables, bs)
        head = 3 * T + 3 * n
        dev[:head].copy_(host[:head], non_blocking=True)
        dev[head:head + size * w].copy_(host[head:head + size * w], non_blocking=True)
        ready.record()
        if ids_dev is not None:
            dev[:rows].copy_(ids_dev[:rows])
        if step.device_drafts is not None:
            _write_device_drafts(dev[:rows * q].view(rows, q), step.device_drafts)
        graph, logits, aux = self.graphs[self._key(size, q)]
        graph.replay()
        if q == 1:
            self.replays += 1
        else:
            self.verify_replays += 1
        if aux is not None:  # a copy: the drafter may read these rows after a later replay reuses the pool
            own = real_rows(q, step.drafts) if q > 1 and min(step.drafts) < q - 1 else None
            self.model.aux_hidden = aux[:rows * q].clone() if own is None else \
                aux[to_device(own, aux.device)]  # the rows' own tokens, packed as an eager step has them
        return logits[:rows * q]

    def drop_verify_graphs(self) -> None:
        """Forget the verify graphs (q > 1): they hold buffers that were replaced (a hybrid model's trail buffers
        made again for a wider row); they are captured again on first use."""
        for key in [key for key in self.graphs if key[1] > 1]:
            del self.graphs[key]

    def report(self) -> dict:
        return {"used": self.replays + self.verify_replays > 0, "replays": self.replays,
                "verify_replays": self.verify_replays,
                "captured_sizes": sorted({size for size, q, _ in self.graphs if q == 1}),
                "captured_verify_sizes": sorted({size for size, q, _ in self.graphs if q > 1}),
                "captured_verify_widths": sorted({q for _, q, _ in self.graphs if q > 1}),
                "captures": self.captures, "capture_s": round(self.capture_s, 3),
                "verify_query_len": self.verify_query_len, "disabled_reason": self.disabled_reason,
                "verify_disabled_reason": self.verify_disabled_reason}
