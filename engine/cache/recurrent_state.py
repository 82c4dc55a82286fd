"""The recurrent state of a hybrid model's linear-attention layers, kept next to the paged KV cache.

A request holds one state slot while it runs (the block manager hands slots out with its KV blocks and takes
them back when the request finishes or is preempted; `Sequence.state_slot`). A slot holds, for every
linear-attention layer, the short convolution's last K-1 inputs (model dtype) and the Gated DeltaNet state
(float32). A request that starts from position 0 (new, or recomputed after preemption) starts from a zeroed
slot.

Unlike a KV block, a state summarizes the whole prefix. With mamba_cache_mode `align` the engine ends every
prefill chunk at a block boundary where it can, and after each step that leaves a request exactly at a
block boundary copies its state into a snapshot keyed by that block's prefix hash (`save`); a prefix-cache
hit may then end only at a block with a snapshot, which is copied into the request's slot (`restore`).
Snapshots are kept least-recently-saved first out; one that a waiting request has matched is pinned until it
is restored or the request leaves. With mamba_cache_mode `none` there are no snapshots and prefix caching
is off for hybrid models. Under tensor parallelism every rank keeps its heads' share of every state and
snapshot; rank 0's block manager decides the snapshots, and the other ranks repeat its copies (`replay`) before
the next step.

Speculative decoding verifies 1 + k tokens of a request in one step, but only the accepted ones stay. A verify
chunk runs as a row of tokens (`VerifyRows`: in a CUDA graph's verify step every row is `width` tokens, the
request's own behind `lead` padding tokens; an eager chunk is one row without padding): the layers keep, per
slot, the state before the row (`pre_ssm`), the row's delta-rule inputs and its convolution inputs (the trail
buffers, `reserve_verify`), and leave the state after all of the row's own tokens in the slot. When the next
step starts inside that chunk (drafts were rejected), the cache rolls the slot back: the convolution state is
a window of the kept inputs, and the delta-rule state is recomputed from `pre_ssm` over the accepted tokens,
every layer in one call (`recurrence`, given by the model: the same one-token arithmetic as the row).

CUDA graphs (engine/worker/cuda_graph.py) replay pure decode steps and verify steps. Such a step takes its plan
from `decode_plan` / `verify_plan`: the rows' slots (and leads) in static device tensors that the graph runner
fills before each replay, and the layers gather, update and scatter the state rows of those slots inside the
cache's own tensors. One slot beyond `num_slots` (`scratch_slot`) is never handed out: the padded rows of a
graph step read and write it, so they never touch a request's state. The host-side work of a step (zeroing the
slot of a request at position 0, rolling a slot back after rejected drafts, counting positions) stays out of
the graph: `prepare_decode` / `prepare_verify` do it before the replay.
"""
from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass

import torch

from onecat.engine.transfers import to_device


@dataclass(slots=True)
class Trail:
    """A verify chunk of a slot's request that starts at position `first`: its row in the trail buffers holds
    `lead` padding tokens, then the request's `own` tokens."""

    first: int
    lead: int
    own: int


@dataclass(slots=True)
class VerifyRows:
    """Verify chunks run as rows of `width` tokens, one request each: row r is `lead[r]` padding tokens then the
    request's own (its token and drafts), and keeps its state in `slots[r]` (int64 device tensors)."""

    slots: torch.Tensor
    lead: torch.Tensor
    width: int


@dataclass(slots=True)
class StatePlan:
    """Where one step's requests keep their state: the one-token requests as a batch (rows of the step's
    tokens, and their slots), the longer chunks one by one as (first row, end row, slot, VerifyRows of a
    speculative verify chunk or None: a prefill chunk); or, in a CUDA graph's verify step, every token in
    `rows`. The trail buffers a verify row keeps its inputs in come with it."""

    conv: torch.Tensor  # [layers, slots, C, K-1]
    ssm: torch.Tensor  # [layers, slots, H, Dk, Dv]
    decode_rows: torch.Tensor | None
    decode_slots: torch.Tensor | None
    chunks: list[tuple[int, int, int, VerifyRows | None]]
    all_decode: bool = False  # every row is a one-token step, row i with slot decode_slots[i] (decode_rows unused)
    rows: VerifyRows | None = None  # a graph's verify step: the whole step is verify rows
    trails: "VerifyTrails | None" = None


@dataclass(slots=True)
class VerifyTrails:
    """Per layer and slot: the state before the slot's last verify row, and that row's inputs (width tokens)."""

    pre_ssm: torch.Tensor  # [layers, slots, H, Dk, Dv] float32
    conv: torch.Tensor  # [layers, slots, C, K-1 + width]: the carried-over inputs, then the row's
    k: torch.Tensor  # [layers, slots, width, Hk, Dk] as projected
    v: torch.Tensor  # [layers, slots, width, H, Dv]
    g: torch.Tensor  # [layers, slots, width, H] float32
    beta: torch.Tensor  # [layers, slots, width, H] float32

    @property
    def width(self) -> int:
        return self.k.shape[2]


class RecurrentStateCache:
    def __init__(self, num_layers: int, num_slots: int, conv_dim: int, conv_kernel: int, heads: int, k_dim: int,
                 v_dim: int, dtype: torch.dtype, device: torch.device, num_snapshots: int = 0,
                 k_heads: int | None = None, recurrence=None):
        """`recurrence`: the delta rule over rows of tokens (engine/layers/gated_deltanet.py delta_rows), with
        which a rolled-back slot's state is recomputed; `k_heads`: the key heads (the value heads by default)."""
        self.num_slots, self.num_snapshots = num_slots, num_snapshots
        self.k_heads, self.recurrence = k_heads or heads, recurrence
        self.scratch_slot = num_slots  # written by the padded rows of a CUDA graph step, never handed out
        self.conv = torch.zeros(num_layers, num_slots + 1, conv_dim, conv_kernel - 1, dtype=dtype, device=device)
        self.ssm = torch.zeros(num_layers, num_slots + 1, heads, k_dim, v_dim, dtype=torch.float32, device=device)
        self.snap_conv = torch.zeros(num_layers, num_snapshots, *self.conv.shape[2:], dtype=dtype, device=device)
        self.snap_ssm = torch.zeros(num_layers, num_snapshots, *self.ssm.shape[2:], dtype=torch.float32, device=device)
        self.snapshots: OrderedDict[int, int] = OrderedDict()  # prefix hash -> snapshot index, oldest first
        self.free_snapshots = list(range(num_snapshots))
        self.pins: Counter[int] = Counter()  # prefix hash -> waiting requests that matched it
        self.saved = self.restored = 0  # counts, for reports and tests
        self.position = [0] * (num_slots + 1)  # tokens each slot's state has consumed
        self.trails: dict[int, Trail] = {}  # slot -> where its last verify chunk lies in the trail buffers
        self.verify_trails: VerifyTrails | None = None  # reserve_verify
        self.rollbacks = 0
        self.journal: list[tuple] | None = None  # tensor parallel, rank 0: the snapshot copies the workers repeat

    @property
    def nbytes(self) -> int:
        kept = (self.conv, self.ssm, self.snap_conv, self.snap_ssm)
        if self.verify_trails is not None:
            t = self.verify_trails
            kept += (t.pre_ssm, t.conv, t.k, t.v, t.g, t.beta)
        return sum(x.numel() * x.element_size() for x in kept)

    def reserve_verify(self, width: int) -> VerifyTrails:
        """The trail buffers for verify rows of up to `width` tokens (speculative decoding: 1 + k), kept for every
        slot; made once (again only for a wider row)."""
        old = self.verify_trails
        if old is None or old.width < width:
            layers, slots, heads, k_dim, v_dim = self.ssm.shape
            c, k1 = self.conv.shape[2:]
            dev, dtype = self.conv.device, self.conv.dtype
            f32 = dict(dtype=torch.float32, device=dev)
            new = VerifyTrails(
                torch.zeros_like(self.ssm), torch.zeros(layers, slots, c, k1 + width, dtype=dtype, device=dev),
                torch.zeros(layers, slots, width, self.k_heads, k_dim, dtype=dtype, device=dev),
                torch.zeros(layers, slots, width, heads, v_dim, dtype=dtype, device=dev),
                torch.zeros(layers, slots, width, heads, **f32), torch.zeros(layers, slots, width, heads, **f32))
            if old is not None:  # the rows kept so far stay readable
                new.pre_ssm.copy_(old.pre_ssm)
                new.conv[..., :old.conv.shape[-1]] = old.conv
                for name in ("k", "v", "g", "beta"):
                    getattr(new, name)[:, :, :old.width] = getattr(old, name)
            self.verify_trails = new
        return self.verify_trails

    # ---- snapshots at block boundaries (mamba_cache_mode align) ----------------------------------------
    def has(self, key: int) -> bool:
        return key in self.snapshots

    def save(self, slot: int, key: int, position: int | None = None) -> None:
        """Keep slot's state as the state after the prefix whose last block hashes to `key` (a copy already kept
        for that prefix stays: the same tokens give the same state). No room and every snapshot pinned: not kept.
        `position`, the prefix's length: not kept either when the slot has moved past it (the one-step-ahead
        decode has already launched the next token's step for this request)."""
        if key in self.snapshots or (position is not None and self.position[slot] != position):
            return
        if self.free_snapshots:
            index = self.free_snapshots.pop()
        else:
            victim = next((k for k in self.snapshots if not self.pins[k]), None)
            if victim is None:
                return
            index = self.snapshots.pop(victim)
        self._copy_to_snapshot(slot, index)
        self.snapshots[key] = index
        self.saved += 1

    def _copy_to_snapshot(self, slot: int, index: int) -> None:
        self.snap_conv[:, index] = self.conv[:, slot]
        self.snap_ssm[:, index] = self.ssm[:, slot]
        if self.journal is not None:
            self.journal.append(("save", slot, index))

    def _copy_from_snapshot(self, index: int, slot: int, position: int) -> None:
        self.conv[:, slot] = self.snap_conv[:, index]
        self.ssm[:, slot] = self.snap_ssm[:, index]
        self.position[slot] = position
        self.trails.pop(slot, None)
        if self.journal is not None:
            self.journal.append(("restore", index, slot, position))

    # ---- tensor parallel: every rank holds its heads' share of each state --------------------------------
    def take_journal(self) -> list[tuple]:
        """Rank 0: the snapshot copies made since the last call, for the worker ranks to `replay` before the next
        step (which snapshot is kept where is decided once, on rank 0, by its block manager)."""
        if not self.journal:
            return []
        ops, self.journal = self.journal, []
        return ops

    def replay(self, ops: list[tuple]) -> None:
        """A worker rank: make rank 0's snapshot copies on this rank's share of the states, in order."""
        for op in ops:
            if op[0] == "save":
                self._copy_to_snapshot(*op[1:])
            else:
                self._copy_from_snapshot(*op[1:])

    def forget_snapshots(self) -> None:
        """Drop every snapshot (the prefix cache was reset; no request holds a pin then)."""
        self.snapshots.clear()
        self.pins.clear()
        self.free_snapshots = list(range(self.num_snapshots))

    def pin(self, key: int) -> None:
        self.pins[key] += 1

    def unpin(self, key: int) -> None:
        self.pins[key] -= 1
        if self.pins[key] <= 0:
            del self.pins[key]

    def restore(self, key: int, slot: int, position: int) -> None:
        """Copy the (pinned) snapshot of `key`, the state after `position` tokens, into `slot`, and unpin it."""
        self._copy_from_snapshot(self.snapshots[key], slot, position)
        self.unpin(key)
        self.restored += 1

    def _roll_back(self, slot: int, start: int) -> None:
        """Set `slot` to the state after `start` tokens, inside its last verify chunk (drafts were rejected): the
        convolution's last K-1 inputs from the kept ones, the delta-rule state recomputed from the state before
        the chunk over the accepted tokens, every layer in one call."""
        trail, t = self.trails.get(slot), self.verify_trails
        if trail is None or not trail.first < start <= trail.first + trail.own:
            raise RuntimeError(f"state slot {slot} holds the state after {self.position[slot]} tokens and keeps "
                               f"none after {start}: the engine and the recurrent state disagree")
        used, lead, k1 = start - trail.first, trail.lead, self.conv.shape[-1]
        # the request's own inputs are the carried-over K-1, then the row's after its padding
        window = to_device([p if p < k1 else p + lead for p in range(used, used + k1)], self.conv.device)
        self.conv[:, slot] = t.conv[:, slot].index_select(-1, window)  # (a list index would copy it synchronously)
        layers, slots = self.ssm.shape[:2]
        index = torch.arange(layers, device=self.ssm.device) * slots + slot
        flat = (lambda x: x.view(layers * slots, *x.shape[2:]))
        own = (lambda x: x[:, slot])
        fill = (lambda v: torch.full((layers,), v, dtype=torch.int64, device=self.ssm.device))
        # q: any (no outputs are wanted), so the kept keys stand in for it
        self.recurrence(own(t.k), own(t.k), own(t.v), own(t.g), own(t.beta), flat(t.pre_ssm), index, flat(self.ssm),
                        index, fill(lead), fill(lead + used), with_outputs=False)
        self.rollbacks += 1

    def _zero(self, slot: int) -> None:
        self.conv[:, slot].zero_()
        self.ssm[:, slot].zero_()

    def _enter(self, slot: int, q: int, n: int) -> None:
        """Host bookkeeping of a step that runs q tokens of `slot`'s request up to position n: a request at
        position 0 starts from a zeroed slot, one inside its last verify chunk from the state rolled back to
        its position."""
        start = n - q
        if start == 0:
            self._zero(slot)
        elif self.position[slot] != start:
            self._roll_back(slot, start)
        self.trails.pop(slot, None)
        self.position[slot] = n

    @staticmethod
    def _check(slots) -> None:
        if slots is None or any(s is None for s in slots):
            raise RuntimeError("a hybrid model's step needs a state slot for every request (the engine hands "
                               "them out with the KV blocks)")

    def step_plan(self, query_lens: list[int], seq_lens: list[int], slots: list[int | None] | None,
                  lookaheads: list[int] | None = None) -> StatePlan:
        """The plan of an eager step; the slots of requests that start at position 0 are zeroed first, those that
        start inside their last verify chunk rolled back to that position. A verify chunk (lookahead) is a row
        without padding."""
        self._check(slots)
        dev = self.conv.device
        decode_rows, decode_slots, chunks, row = [], [], [], 0
        as_tensor = (lambda xs: to_device(xs, dev, torch.int64) if xs else None)
        widths = [q for q, d in zip(query_lens, lookaheads or []) if d]
        trails = self.reserve_verify(max(widths)) if widths else None
        for i, (slot, q, n) in enumerate(zip(slots, query_lens, seq_lens)):
            self._enter(slot, q, n)
            if q == 1:
                decode_rows.append(row)
                decode_slots.append(slot)
            else:
                rows = None
                if lookaheads is not None and lookaheads[i]:
                    self.trails[slot] = Trail(n - q, 0, q)
                    rows = VerifyRows(as_tensor([slot]), as_tensor([0]), q)
                chunks.append((row, row + q, slot, rows))
            row += q
        return StatePlan(self.conv, self.ssm, as_tensor(decode_rows), as_tensor(decode_slots), chunks,
                         all_decode=not chunks, trails=trails)

    # ---- pure decode and verify steps replayed from CUDA graphs --------------------------------------------
    def prepare_decode(self, slots: list[int | None], seq_lens: list[int]) -> None:
        """The host side of a pure decode step (one token per request, request i ending at seq_lens[i]),
        before the graph that runs it is replayed."""
        self._check(slots)
        for slot, n in zip(slots, seq_lens):
            self._enter(slot, 1, n)

    def prepare_verify(self, slots: list[int | None], seq_lens: list[int], own: list[int], width: int) -> None:
        """The host side of a graph's verify step: request i runs own[i] tokens (its token and drafts) up to
        position seq_lens[i], behind width - own[i] padding tokens of its row."""
        self._check(slots)
        self.reserve_verify(width)
        for slot, n, q in zip(slots, seq_lens, own):
            self._enter(slot, q, n)
            self.trails[slot] = Trail(n - q, width - q, q)

    def decode_plan(self, slots: torch.Tensor) -> StatePlan:
        """The plan of a pure decode step whose rows' slots are in the device tensor `slots` (one per row; the
        padded rows of a graph step hold `scratch_slot`). Builds nothing on the host: graph-safe."""
        return StatePlan(self.conv, self.ssm, None, slots, [], all_decode=True)

    def verify_plan(self, slots: torch.Tensor, lead: torch.Tensor, width: int) -> StatePlan:
        """The plan of a graph's verify step: every row `width` tokens, its slot and padding in device tensors.
        Graph-safe."""
        return StatePlan(self.conv, self.ssm, None, None, [], rows=VerifyRows(slots, lead, width),
                         trails=self.reserve_verify(width))
