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
is off for hybrid models.
"""
from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass

import torch


@dataclass(slots=True)
class StatePlan:
    """Where one step's requests keep their state: the one-token requests as a batch (rows of the step's
    tokens, and their slots), the longer chunks (prefill) one by one as (first row, end row, slot)."""

    conv: torch.Tensor  # [layers, slots, C, K-1]
    ssm: torch.Tensor  # [layers, slots, H, Dk, Dv]
    decode_rows: torch.Tensor | None
    decode_slots: torch.Tensor | None
    chunks: list[tuple[int, int, int]]


class RecurrentStateCache:
    def __init__(self, num_layers: int, num_slots: int, conv_dim: int, conv_kernel: int, heads: int, k_dim: int,
                 v_dim: int, dtype: torch.dtype, device: torch.device, num_snapshots: int = 0):
        self.num_slots, self.num_snapshots = num_slots, num_snapshots
        self.conv = torch.zeros(num_layers, num_slots, conv_dim, conv_kernel - 1, dtype=dtype, device=device)
        self.ssm = torch.zeros(num_layers, num_slots, heads, k_dim, v_dim, dtype=torch.float32, device=device)
        self.snap_conv = torch.zeros(num_layers, num_snapshots, *self.conv.shape[2:], dtype=dtype, device=device)
        self.snap_ssm = torch.zeros(num_layers, num_snapshots, *self.ssm.shape[2:], dtype=torch.float32, device=device)
        self.snapshots: OrderedDict[int, int] = OrderedDict()  # prefix hash -> snapshot index, oldest first
        self.free_snapshots = list(range(num_snapshots))
        self.pins: Counter[int] = Counter()  # prefix hash -> waiting requests that matched it
        self.saved = self.restored = 0  # counts, for reports and tests

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.conv, self.ssm, self.snap_conv, self.snap_ssm))

    # ---- snapshots at block boundaries (mamba_cache_mode align) ----------------------------------------
    def has(self, key: int) -> bool:
        return key in self.snapshots

    def save(self, slot: int, key: int) -> None:
        """Keep slot's state as the state after the prefix whose last block hashes to `key` (a copy already kept
        for that prefix stays: the same tokens give the same state). No room and every snapshot pinned: not kept."""
        if key in self.snapshots:
            return
        if self.free_snapshots:
            index = self.free_snapshots.pop()
        else:
            victim = next((k for k in self.snapshots if not self.pins[k]), None)
            if victim is None:
                return
            index = self.snapshots.pop(victim)
        self.snap_conv[:, index] = self.conv[:, slot]
        self.snap_ssm[:, index] = self.ssm[:, slot]
        self.snapshots[key] = index
        self.saved += 1

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

    def restore(self, key: int, slot: int) -> None:
        """Copy the (pinned) snapshot of `key` into `slot`, and unpin it."""
        index = self.snapshots[key]
        self.conv[:, slot] = self.snap_conv[:, index]
        self.ssm[:, slot] = self.snap_ssm[:, index]
        self.unpin(key)
        self.restored += 1

    def step_plan(self, query_lens: list[int], seq_lens: list[int], slots: list[int | None] | None) -> StatePlan:
        """The step's plan; the slots of requests that start at position 0 are zeroed first."""
        if slots is None or any(s is None for s in slots):
            raise RuntimeError("a hybrid model's step needs a state slot for every request (the engine hands "
                               "them out with the KV blocks)")
        dev = self.conv.device
        fresh = [slot for slot, q, n in zip(slots, query_lens, seq_lens) if n == q]
        if fresh:
            idx = torch.tensor(fresh, device=dev)
            self.conv[:, idx] = 0
            self.ssm[:, idx] = 0
        decode_rows, decode_slots, chunks, row = [], [], [], 0
        for slot, q in zip(slots, query_lens):
            if q == 1:
                decode_rows.append(row)
                decode_slots.append(slot)
            else:
                chunks.append((row, row + q, slot))
            row += q
        as_tensor = (lambda xs: torch.tensor(xs, dtype=torch.int64, device=dev) if xs else None)
        return StatePlan(self.conv, self.ssm, as_tensor(decode_rows), as_tensor(decode_slots), chunks)
