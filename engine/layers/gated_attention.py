"""Full attention of Qwen3.5: q_proj gives each head its query and a gate side by side; q and k get a
zero-centered RMSNorm per head and RoPE on their first `rotary_dim` dims only (partial rotary); the paged
attention output is multiplied by SIGMOID(gate) before o_proj. With fused kernels on (CUDA; and
hybrid_kernels.ENABLED) the ops around the attention run in two kernels
(engine/kernels/triton_gated_attention.py)."""
from __future__ import annotations

import torch
from torch import nn

from onecat.engine.attention.forward_context import get_forward_context
from onecat.engine.cache.kv import write_kv
from onecat.engine.config import ModelConfig
from onecat.engine.layers import hybrid_kernels
from onecat.engine.layers.linear import Linear
from onecat.engine.layers.pointwise import pointwise
from onecat.engine.layers.qwen3_5_norms import ZeroCenteredRMSNorm
from onecat.engine.layers.rotary import RotaryEmbedding


class GatedAttention(nn.Module):
    use_fused = False  # the engine turns this on per model (CUDA + Triton); the two kernels need hybrid_kernels too

    def __init__(self, cfg: ModelConfig, kv_index: int, rotary: RotaryEmbedding):
        super().__init__()
        self.kv_index = kv_index  # this layer's place among the KV caches (linear layers keep none)
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, 2 * self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=cfg.attention_bias)
        self.q_norm = ZeroCenteredRMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.rotary = rotary
        self.rotary_dim = rotary.head_dim
        self.scale = self.head_dim ** -0.5
        self._fused_why: tuple | None = None  # (cache kind, why the fused kernels cannot run) once asked
        q2 = 2 * self.q_size
        self.checkpoint_parts = {"q_proj": ("qkv_proj", 0, q2), "k_proj": ("qkv_proj", q2, self.kv_size),
                                 "v_proj": ("qkv_proj", q2 + self.kv_size, self.kv_size)}

    def _rope(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        r = self.rotary_dim
        if r == self.head_dim:
            return self.rotary.rotate(positions, x)
        return torch.cat([self.rotary.rotate(positions, x[..., :r]), x[..., r:]], dim=-1)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        T, d = x.shape[0], self.head_dim
        ctx = get_forward_context()
        cache = ctx.kv_caches[self.kv_index]
        qkv = self.qkv_proj(x)
        if self.use_fused and hybrid_kernels.ENABLED and x.is_cuda and self._fused_reason(cache) is None:
            return self._fused(positions, qkv, cache, ctx)
        query_gate, k, v = qkv.split([2 * self.q_size, self.kv_size, self.kv_size], dim=-1)
        query_gate = query_gate.view(T, self.num_heads, 2 * d)
        gate = query_gate[..., d:].reshape(T, self.q_size)
        q = self._rope(positions, self.q_norm(query_gate[..., :d]))
        k = self._rope(positions, self.k_norm(k.view(T, self.num_kv_heads, d)))
        write_kv(cache, k, v.view(T, self.num_kv_heads, d), ctx.meta.slot_mapping)
        out = ctx.attention(q.contiguous(), cache, ctx.meta, self.scale)
        return self.o_proj(out.reshape(T, self.q_size) * pointwise(torch.sigmoid, gate))

    def _fused_reason(self, cache) -> str | None:
        """Why the fused kernels cannot take this layer's steps (None: they can); asked once per cache kind."""
        key = (cache.fp8_dtype, cache.k.device)
        if self._fused_why is None or self._fused_why[0] != key:
            from onecat.engine.kernels.triton_gated_attention import unsupported_reason

            why = unsupported_reason(self.head_dim, self.rotary_dim, cache.fp8_dtype, cache.k.device)
            self._fused_why = (key, why)
        return self._fused_why[1]

    def _fused(self, positions: torch.Tensor, qkv: torch.Tensor, cache, ctx) -> torch.Tensor:
        """forward's ops around the paged attention in two kernels (engine/kernels/triton_gated_attention.py):
        q/k norms, RoPE and the cache write; the sigmoid gate."""
        from onecat.engine.kernels.triton_gated_attention import qk_norm_rope_cache, sigmoid_gate

        q = qk_norm_rope_cache(qkv, positions, self.rotary.cos, self.rotary.sin, self.num_heads, self.num_kv_heads,
                               self.head_dim, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, cache,
                               ctx.meta.slot_mapping)
        out = ctx.attention(q, cache, ctx.meta, self.scale)
        return self.o_proj(sigmoid_gate(out, qkv, self.num_heads, self.head_dim))
