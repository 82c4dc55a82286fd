"""Paged KV cache storage: allocation and writes (model dtype, or 8-bit float with per-token scales).

A KV cache for one layer is a `LayerKVCache`: K and V stored as
`[num_blocks, block_size, num_kv_heads, head_dim]` in the storage dtype (model dtype, or uint8
bytes holding float8_e4m3fn / float8_e5m2 values) plus, for 8-bit storage, fp32 scales of shape
`[num_blocks, block_size, num_kv_heads]` (one per stored token and head: value = fp8 * scale).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


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


def allocate_kv_caches(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                       dtype: torch.dtype, fp8_dtype: torch.dtype | None, device: torch.device) -> list[LayerKVCache]:
    """Block 0 is the null block: never handed out, the target of padded block-table entries.

    Everything starts zeroed: attention paths that read whole blocks see the unwritten tail of a
    sequence's last block (masked out, weight 0), and it must hold finite numbers, never NaN garbage.
    """
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    store = dtype if fp8_dtype is None else torch.uint8
    caches = []
    for _ in range(num_layers):
        k, v = (torch.zeros(shape, dtype=store, device=device) for _ in range(2))
        ks = vs = None
        if fp8_dtype is not None:
            ks, vs = (torch.ones(shape[:3], dtype=torch.float32, device=device) for _ in range(2))
        caches.append(LayerKVCache(k, v, ks, vs, fp8_dtype))
    return caches


def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                    dtype: torch.dtype, fp8: bool) -> int:
    elem = 1 if fp8 else torch.empty((), dtype=dtype).element_size()
    per_token_head = head_dim * elem + (4 if fp8 else 0)
    return 2 * num_layers * block_size * num_kv_heads * per_token_head


def quantize_fp8(x: torch.Tensor, fp8_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [T, H, D] -> (uint8 bytes [T, H, D], fp32 scale [T, H]); x ≈ fp8 * scale."""
    amax = x.abs().amax(dim=-1).float()
    scale = (amax / torch.finfo(fp8_dtype).max).clamp_min(1e-12)
    q = (x.float() / scale.unsqueeze(-1)).to(fp8_dtype)
    return q.view(torch.uint8), scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype, dtype: torch.dtype) -> torch.Tensor:
    return (q.view(fp8_dtype).float() * scale.unsqueeze(-1)).to(dtype)


def write_kv(cache: LayerKVCache, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """Store the new tokens' K/V ([T, Hkv, D]) at their cache slots."""
    flat_k = cache.k.view(-1, *cache.k.shape[2:])
    flat_v = cache.v.view(-1, *cache.v.shape[2:])
    if cache.fp8_dtype is None:
        flat_k.index_copy_(0, slots, k.to(cache.k.dtype))
        flat_v.index_copy_(0, slots, v.to(cache.v.dtype))
        return
    kq, ks = quantize_fp8(k, cache.fp8_dtype)
    vq, vs = quantize_fp8(v, cache.fp8_dtype)
    flat_k.index_copy_(0, slots, kq)
    flat_v.index_copy_(0, slots, vq)
    cache.k_scale.view(-1, cache.k_scale.shape[-1]).index_copy_(0, slots, ks)
    cache.v_scale.view(-1, cache.v_scale.shape[-1]).index_copy_(0, slots, vs)
