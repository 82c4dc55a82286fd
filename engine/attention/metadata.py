"""Per-step attention metadata: built once per engine step, read by every layer's attention."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class AttentionMetadata:
    """A flattened batch of B sequences holding T new tokens in total.

    Sequence b owns new tokens query_start_loc[b]:query_start_loc[b+1]; after this step it has
    seq_lens[b] tokens of context (cached + new), the new ones being the last. Token t's K/V go to
    cache slot slot_mapping[t] = block * block_size + offset. block_tables[b] lists the physical
    blocks of sequence b (padded with 0 beyond its length).
    """

    query_start_loc: torch.Tensor  # [B+1] int32, device
    seq_lens: torch.Tensor  # [B] int32, device
    block_tables: torch.Tensor  # [B, max_blocks] int32, device
    slot_mapping: torch.Tensor  # [T] int64, device
    max_query_len: int
    max_seq_len: int
    block_size: int
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    # Cached helpers for the reference path (built lazily by whichever backend needs them).
    extras: dict
    # each sequence's leading query rows at prompt positions (CPU steps; the AMX prompt attention's tile rows)
    prompt_lens_cpu: list[int] | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])

    @property
    def is_pure_decode(self) -> bool:
        return self.max_query_len == 1
