"""The DFlash drafter's own KV cache: per request and drafter layer, the keys (after k_norm and RoPE at
absolute positions) and values of its context rows, so each round projects only the new feature rows.

A drafter layer's context keys/values depend only on the target's features (DFlashDrafter.context_kv),
never on the block, so they can be kept. Each request holds the rows of one contiguous run of positions
`first .. end - 1`; the drafter's attention over its context is order-free (non-causal, positions are
in the keys), so only the count of kept rows matters when attending.

Feature rows arrive after every engine step (`add`, as spans of the step's tapped rows), are queued, and are
projected for all requests at once (`flush`) just before drafting, or earlier once many rows wait (a long
prefill, or a batch decoding for a while without drafts) unless drafting is off for now (`defer`: the gate found
drafting slower at this batch size), when they wait compacted, up to DEFER_LIMIT_ROWS, for the next round: a
request that never drafts never pays for its drafter's context. Rows recorded
from a position the request already holds (a preempted request recomputing its tokens) replace the
held rows from that position on; a later run of positions (the target skipped prefix-cached ones)
starts the request's context afresh there. `sliding_window` keeps only the newest rows.
"""
from __future__ import annotations

import torch

from onecat.engine.core.sequence import FeatureRows
from onecat.engine.transfers import to_device

FLUSH_ROWS = 1024  # project queued rows once this many wait, so a long prefill holds no big feature tensors
# while drafting is off (`defer`), queued rows are kept unprojected (compacted, so no step's tensor is held) up to
# this many; past it they are projected as usual: what a paused drafter may hold (float32 features of 5 taps of a
# 576-wide model: 11.5 KB a row, 750 MB at the limit; bf16 taps of a 5,120-wide one: 51 KB, 3.4 GB)
DEFER_LIMIT_ROWS = 65536


def project_rows(drafter, feats: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Every drafter layer's context keys and values of feature rows `feats` [n, L*H] at positions `pos` [n]:
    [layers, 2, n, nkv, hd] (a DFlash drafter lays them out so in one copy; an MTP head's layers are stacked)."""
    stacked = getattr(drafter, "context_kv_stacked", None)
    if stacked is not None:
        return stacked(drafter.context(feats), pos)
    return torch.stack([torch.stack(kv) for kv in drafter.context_kv(drafter.context(feats), pos)])


class _Entry:
    """One request's context rows: kv[:, :, head:head + count] are positions first .. first + count - 1."""

    __slots__ = ("kv", "head", "count", "first")

    def __init__(self, kv: torch.Tensor, first: int):
        self.kv, self.head, self.count, self.first = kv, 0, 0, first

    @property
    def end(self) -> int:
        return self.first + self.count


class DrafterKVCache:
    def __init__(self, drafter):
        attn = drafter.layers[0].self_attn
        self.drafter = drafter
        self.window: int | None = drafter.sliding_window
        self.row_shape = (len(drafter.layers), 2, attn.nkv, attn.hd)
        self.dtype, self.device = drafter.norm.weight.dtype, drafter.norm.weight.device
        self.entries: dict[str, _Entry] = {}
        self.pending: list[tuple[str, int, FeatureRows]] = []  # (request id, first position, feature rows)
        self.pending_rows = 0
        self._pending_prompt = False  # some queued rows are a prompt's (projected once in a request's life)
        self.prompt_flushes = 0  # flushes that projected a prompt's rows (one-time work, not a round's)
        self.defer = False  # drafting is off for now (the gate): queued rows wait for the next round's flush
        self._compact_at = FLUSH_ROWS  # deferred: compact the queue once this many rows wait (doubling)
        self.compactions = 0
        self._batch: torch.Tensor | None = None  # reused padding buffer of batched drafting
        # features [n, L*H] and positions [n] -> rows [layers, 2, n, nkv, hd] by CUDA graph replay, or None to
        # project eagerly (set by the drafter's graphs, dflash_graphs.py)
        self.projector = None

    # ---- recording ------------------------------------------------------------------------------
    def add(self, request_id: str, start: int, features: torch.Tensor | FeatureRows, prompt: bool = False) -> None:
        """Queue the target's features of positions start .. start + count - 1 (a tensor of those rows, or a
        span of a step's rows: nothing is copied until the flush); `prompt`: they include the prompt's."""
        rows = features if isinstance(features, FeatureRows) else FeatureRows(features, 0, features.shape[0])
        if self.window is not None and rows.count > self.window:  # rows the window drops at once
            drop = rows.count - self.window
            start, rows = start + drop, FeatureRows(rows.source, rows.first + drop, self.window)
        self.pending.append((request_id, start, rows))
        self.pending_rows += rows.count
        self._pending_prompt |= prompt
        if self.pending_rows < FLUSH_ROWS:
            return
        if not self.defer or self.pending_rows >= DEFER_LIMIT_ROWS:
            self.flush()
        elif self.pending_rows >= self._compact_at:
            self._compact()

    def _compact(self) -> None:
        """The queued rows copied into one tensor (a request's run of positions one span of it), so the queue holds
        no step's whole tapped tensor; the next compaction waits for twice as many rows (each row copied O(1)
        times on average)."""
        feats, _, runs = self._gathered(self.pending)
        self.pending = [(request_id, start, FeatureRows(feats, at, n)) for request_id, start, at, n in runs]
        self._compact_at = 2 * self.pending_rows
        self.compactions += 1

    @torch.inference_mode()  # its buffers are inference tensors: every write to them happens in this mode
    def flush(self) -> None:
        """Project every queued row (one fc + one K/V projection per layer for all requests) and store it: the
        queued spans are gathered request by request in one index, so that each request's rows (queued a row
        per step while its batch decodes without drafting) are stored with one write per run of positions."""
        if not self.pending:
            return
        pending, self.pending, self.pending_rows = self.pending, [], 0
        self.prompt_flushes += self._pending_prompt
        self._pending_prompt, self._compact_at = False, FLUSH_ROWS
        feats, pos, runs = self._gathered(pending)
        rows = self.projector(feats, pos) if self.projector is not None else None
        if rows is None:
            rows = project_rows(self.drafter, feats.to(self.dtype), pos)
        for request_id, start, at, n in runs:
            self._write(request_id, start, rows[:, :, at:at + n])

    def _gathered(self, pending: list[tuple[str, int, FeatureRows]]):
        """(feature rows [n, L*H] grouped by request, their positions [n], and per run of consecutive positions
        of a request, in the order queued: (request, first position, offset in the rows, count))."""
        sources: dict[int, tuple[int, torch.Tensor]] = {}  # id -> (offset in the concatenation, tensor)
        total = 0
        for _, _, r in pending:
            if id(r.source) not in sources:
                sources[id(r.source)] = (total, r.source)
                total += r.source.shape[0]
        by_request: dict[str, list[list]] = {}  # request -> [[first position, indices in the concatenation]]
        for request_id, start, r in pending:
            at = sources[id(r.source)][0] + r.first
            runs = by_request.setdefault(request_id, [])
            if runs and runs[-1][0] + len(runs[-1][1]) == start:
                runs[-1][1].extend(range(at, at + r.count))
            else:
                runs.append([start, list(range(at, at + r.count))])
        index, positions, out = [], [], []
        for request_id, runs in by_request.items():
            for start, rows in runs:
                out.append((request_id, start, len(index), len(rows)))
                index.extend(rows)
                positions.extend(range(start, start + len(rows)))
        tensors = [t for _, t in sources.values()]
        feats = torch.cat(tensors) if len(tensors) > 1 else tensors[0]
        if index != list(range(total)):
            feats = feats.index_select(0, to_device(index, feats.device))
        return feats, to_device(positions, self.device), out

    @torch.inference_mode()
    def store(self, request_id: str, start: int, rows: torch.Tensor) -> None:
        """Keep rows already projected ([layers, 2, n, nkv, hd], positions start .. start + n - 1), as a flush
        would; rows of the request still queued must be flushed first."""
        self._write(request_id, start, rows)

    def _write(self, request_id: str, start: int, rows: torch.Tensor) -> None:
        e = self.entries.get(request_id)
        if e is None:
            e = self.entries[request_id] = _Entry(self._alloc(rows.shape[2]), start)
        elif e.first <= start <= e.end:
            e.count = start - e.first  # recomputed positions replace what was held from `start` on
        else:
            e.head, e.count, e.first = 0, 0, start
        n = rows.shape[2]
        if e.head + e.count + n > e.kv.shape[2]:
            self._make_room(e, n)
        e.kv[:, :, e.head + e.count:e.head + e.count + n] = rows
        e.count += n
        if self.window is not None and e.count > self.window:
            drop = e.count - self.window
            e.head, e.count, e.first = e.head + drop, self.window, e.first + drop

    def _make_room(self, e: _Entry, n: int) -> None:
        """Move the kept rows to the front (dropping those the window will drop anyway), then grow if needed."""
        keep = e.count if self.window is None else max(0, min(e.count, self.window - n))
        src = e.head + e.count - keep
        e.first += e.count - keep
        need = keep + n
        if need > e.kv.shape[2]:
            kv = self._alloc(max(2 * e.kv.shape[2], need))
            kv[:, :, :keep] = e.kv[:, :, src:src + keep]
            e.kv = kv
        elif keep:
            e.kv[:, :, :keep] = e.kv[:, :, src:src + keep].clone()
        e.head, e.count = 0, keep

    def _alloc(self, rows: int) -> torch.Tensor:
        """Room for `rows` rows (at least 64; at most twice the window, which holds every write: the kept
        rows plus the new ones never exceed the window)."""
        rows = max(rows, 64)
        if self.window is not None:
            rows = min(rows, 2 * self.window)
        layers, two, nkv, hd = self.row_shape
        return torch.empty(layers, two, rows, nkv, hd, dtype=self.dtype, device=self.device)

    # ---- reading ----------------------------------------------------------------------------------
    def has_context(self, request_id: str) -> bool:
        e = self.entries.get(request_id)
        return e is not None and e.count > 0

    def context_end(self, request_id: str) -> int:
        """One past the newest position the request's context holds."""
        return self.entries[request_id].end

    def lengths(self, request_ids: list[str]) -> list[int]:
        return [self.entries[r].count for r in request_ids]

    @torch.inference_mode()
    def gather(self, request_ids: list[str]) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
        """Per layer (keys, values) [R, C, nkv, hd] of the requests' contexts padded to the longest, and
        each request's length [R]. One request reads its rows in place; several are copied into a reused
        buffer."""
        if len(request_ids) == 1:
            e = self.entries[request_ids[0]]
            kv = e.kv[:, :, e.head:e.head + e.count].unsqueeze(2)  # [layers, 2, 1, C, nkv, hd]
            lens = [e.count]
        else:
            R, C = len(request_ids), max(self.lengths(request_ids))
            buf = self._batch
            if buf is None or buf.shape[2] < R or buf.shape[3] < C:
                old = buf.shape[2:4] if buf is not None else (0, 0)
                layers, two, nkv, hd = self.row_shape
                buf = self._batch = torch.zeros(layers, two, max(R, old[0]), max(C, 2 * old[1], 64), nkv, hd,
                                                dtype=self.dtype, device=self.device)
            kv = buf[:, :, :R, :C]
            lens = self.copy_into(request_ids, kv)
        return [(kv[layer, 0], kv[layer, 1]) for layer in range(kv.shape[0])], to_device(lens, self.device)

    @torch.inference_mode()
    def copy_into(self, request_ids: list[str], buf: torch.Tensor) -> list[int]:
        """Copy request r's rows into buf[:, :, r, :count] ([layers, 2, >= R, >= C, nkv, hd]); the lengths.
        Rows past a request's length keep what they held: `buf` must start zeroed (masked rows then hold
        finite values, which contribute exactly 0 after the softmax)."""
        lens = []
        for r, rid in enumerate(request_ids):
            e = self.entries[rid]
            buf[:, :, r, :e.count] = e.kv[:, :, e.head:e.head + e.count]
            lens.append(e.count)
        return lens

    def release(self, request_id: str) -> None:
        self.entries.pop(request_id, None)
        if any(r == request_id for r, _, _ in self.pending):
            self.pending = [p for p in self.pending if p[0] != request_id]
            self.pending_rows = sum(r.count for _, _, r in self.pending)
