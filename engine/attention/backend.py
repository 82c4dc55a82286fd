"""The attention backend interface: each backend is capability-checked per call and falls back.

A KV cache for one layer is a `LayerKVCache`: K and V stored as
`[num_blocks, block_size, num_kv_heads, head_dim]` in the storage dtype (model dtype, or uint8
bytes holding float8_e4m3fn / float8_e5m2 values) plus, for 8-bit storage, fp32 scales of shape
`[num_blocks, block_size, num_kv_heads]` (one per stored token and head: value = fp8 * scale).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from onecat.engine.attention.metadata import AttentionMetadata


@dataclass(slots=True)
class LayerKVCache:
    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None  # None unless 8-bit storage
    v_scale: torch.Tensor | None
    fp8_dtype: torch.dtype | None  # torch.float8_e4m3fn / torch.float8_e5m2 when 8-bit

    @property
    def is_fp8(self) -> bool:
        return self.fp8_dtype is not None


class AttentionBackend(ABC):
    """Computes attention of the step's new queries over each sequence's whole cached context."""

    name: str = "abstract"

    @abstractmethod
    def unsupported_reason(self, q: torch.Tensor, cache: LayerKVCache,
                           meta: AttentionMetadata) -> str | None:
        """None when this call can run here; otherwise why not (the caller then falls back)."""

    @abstractmethod
    def forward(self, q: torch.Tensor, cache: LayerKVCache, meta: AttentionMetadata,
                scale: float) -> torch.Tensor:
        """q: [T, num_heads, head_dim] -> [T, num_heads, head_dim]; causal within each sequence.

        The K/V of the new tokens are already written into `cache` at meta.slot_mapping.
        """
