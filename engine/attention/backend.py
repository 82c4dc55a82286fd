"""The attention backend interface: each backend is capability-checked per call and falls back.

Backends read one layer's paged cache, a `LayerKVCache` (engine/cache/kv.py describes its layout).
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from onecat.engine.attention.metadata import AttentionMetadata
from onecat.engine.cache.kv import LayerKVCache


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
