"""Self-attention block on the fused QKV projection's output (the caller projects): optional
per-head q/k RMSNorm (Qwen3), RoPE, paged KV, output projection.

With fused kernels on (CUDA), q/k norm, RoPE and the K/V cache write are one kernel working in place
on the QKV projection's output, or (ONECAT_ROPE_IN_SPLIT, pure decode on TRITON_PAGED) part of the attention
kernel; fp8 caches and odd head sizes take the reference path.
"""
from __future__ import annotations

import torch
from torch import nn

from onecat.engine.attention.forward_context import get_forward_context
from onecat.engine.cache.kv import write_kv
from onecat.engine.config import ModelConfig
from onecat.engine.layers.linear import Linear
from onecat.engine.layers.norm import RMSNorm
from onecat.engine.layers.rotary import RotaryEmbedding


class SelfAttention(nn.Module):
    use_fused = False  # the engine turns this on per model (CUDA + Triton)
    cpu_ops = None  # the fused CPU ops (engine/kernels/cpu_ops.py), when the engine turns them on

    def __init__(self, cfg: ModelConfig, layer_idx: int, rotary: RotaryEmbedding, qk_norm: bool):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=False)
        self.rotary = rotary
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if qk_norm else None
        self.scale = self.head_dim ** -0.5

    def _fused_ok(self, qkv: torch.Tensor, cache) -> bool:
        d = self.head_dim
        return (self.use_fused and qkv.is_cuda and cache.fp8_dtype is None and cache.k.dtype == qkv.dtype
                and d >= 16 and d & (d - 1) == 0 and qkv.stride(-1) == 1)

    def _cpu_fused_ok(self, qkv: torch.Tensor, cache) -> bool:
        return (self.cpu_ops is not None and not qkv.is_cuda and self.q_norm is None and cache.fp8_dtype is None
                and qkv.dtype == torch.float32 and cache.k.dtype in (torch.float32, torch.bfloat16)
                and qkv.stride(-1) == 1)

    def forward(self, positions: torch.Tensor, qkv: torch.Tensor) -> torch.Tensor:
        """Attention output projected by o_proj, from the qkv_proj output (the caller projects, so it
        can fold the preceding RMSNorm into that projection)."""
        T = qkv.shape[0]
        ctx = get_forward_context()
        cache = ctx.kv_caches[self.layer_idx]
        if self._fused_ok(qkv, cache):
            norm = self.q_norm is not None
            qw, kw, eps = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps) if norm else (None, None, 0.0)
            q = qkv[:, :self.q_size].view(T, self.num_heads, self.head_dim)
            if ctx.attention.takes_new_tokens(q, cache, ctx.meta):  # the attention kernel rotates and stores them
                from onecat.engine.kernels.triton_paged_decode import NewTokens

                new = NewTokens(qkv[:, self.q_size:], positions, self.rotary.cos, self.rotary.sin,
                                ctx.meta.slot_mapping, qw, kw, eps)
                return self.o_proj(ctx.attention.with_new_tokens(q, new, cache, ctx.meta, self.scale)
                                   .reshape(T, self.q_size))
            from onecat.engine.kernels.triton_fused import qk_rope_cache

            qk_rope_cache(qkv, positions, self.rotary.cos, self.rotary.sin, self.num_heads, self.num_kv_heads,
                          self.head_dim, cache.k, cache.v, ctx.meta.slot_mapping, qw, kw, eps)
        elif self._cpu_fused_ok(qkv, cache):  # RoPE on q and k in place, and the K/V cache write: one call
            self.cpu_ops.rope_write_kv(qkv, positions, self.rotary.cos, self.rotary.sin, self.num_heads,
                                       self.num_kv_heads, cache.k, cache.v, ctx.meta.slot_mapping)
            q = qkv[:, :self.q_size].view(T, self.num_heads, self.head_dim)
        else:
            q = self._rotate_and_store(positions, qkv, cache, ctx.meta.slot_mapping)
        out = ctx.attention(q, cache, ctx.meta, self.scale)
        return self.o_proj(out.reshape(T, self.q_size))

    def _rotate_and_store(self, positions: torch.Tensor, qkv: torch.Tensor, cache, slots: torch.Tensor) -> torch.Tensor:
        """The reference ops: q/k norm (Qwen3), RoPE, the K/V cache write; returns q [T, Hq, D]."""
        T = qkv.shape[0]
        v = qkv[:, self.q_size + self.kv_size:].view(T, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k, _ = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = self.q_norm(q.view(T, self.num_heads, self.head_dim))
            k = self.k_norm(k.view(T, self.num_kv_heads, self.head_dim))
            q, k = self.rotary(positions, q, k)
        else:  # q and k side by side in qkv: one rotation of all their heads
            qk = self.rotary.rotate(positions, qkv[:, :self.q_size + self.kv_size].view(T, -1, self.head_dim))
            q, k = qk[:, :self.num_heads].contiguous(), qk[:, self.num_heads:]  # a copy only when T > 1
        write_kv(cache, k, v, slots)
        return q
