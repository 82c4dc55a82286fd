"""The recurrent state of a hybrid model's linear-attention layers, kept next to the paged KV cache.

A request holds one state slot while it runs (the block manager hands slots out with its KV blocks and takes
them back when the request finishes or is preempted; `Sequence.state_slot`). A slot holds, for every
linear-attention layer, the short convolution's last K-1 inputs (model dtype) and the Gated DeltaNet state
(float32). Unlike KV blocks a state summarizes the whole prefix and cannot be shared or kept for a prefix
cache (mamba_cache_mode none): a request that starts from position 0 (new, or recomputed after
preemption) starts from a zeroed slot.
"""
from __future__ import annotations

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
                 v_dim: int, dtype: torch.dtype, device: torch.device):
        self.num_slots = num_slots
        self.conv = torch.zeros(num_layers, num_slots, conv_dim, conv_kernel - 1, dtype=dtype, device=device)
        self.ssm = torch.zeros(num_layers, num_slots, heads, k_dim, v_dim, dtype=torch.float32, device=device)

    @property
    def nbytes(self) -> int:
        return self.conv.numel() * self.conv.element_size() + self.ssm.numel() * self.ssm.element_size()

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
