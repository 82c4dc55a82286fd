"""The multi-token-prediction (MTP) head that Qwen3.5 and Qwen3.5-MoE checkpoints carry as `mtp.*` tensors.

Position i of a sequence, with the target's last hidden state h_i (after its final norm) and the next token
t_{i+1}:

    x_i = fc(concat(pre_fc_norm_embedding(embed(t_{i+1})), pre_fc_norm_hidden(h_i)))
    y_i = norm(decoder_layer(x_i))       one full-attention layer (gated attention, partial RoPE) with a dense
                                          MLP or a sparse MoE like the target's; its keys/values are its own
    logits_i = the target's lm_head(y_i)  a guess at t_{i+2}

A further guess feeds the head its own output: h <- y_i, t <- the guess, at position i + 1 (as vLLM's
`qwen3_next_mtp` / `qwen3_5_mtp` and their proposer do). embed and lm_head are the target's.

The keys/values of a position depend only on (h_i, t_{i+1}), so a runtime keeps them per request
(`context` / `context_kv` are the interface of the drafter KV cache, speculative/dflash_cache.py) and runs one
query row per draft step (`draft_step`). speculative/mtp_weights.py reads the `mtp.*` tensors into it.
"""
from __future__ import annotations

import torch
from torch import nn

from onecat.engine.config import ModelConfig
from onecat.engine.layers.gated_attention import GatedAttention
from onecat.engine.layers.linear import Linear
from onecat.engine.layers.pointwise import pointwise
from onecat.engine.layers.qwen3_5_norms import ZeroCenteredRMSNorm
from onecat.engine.layers.rotary import RotaryEmbedding
from onecat.engine.models.qwen3_5 import HybridDecoderLayer


class MTPAttention(GatedAttention):
    """Qwen3.5's gated attention (same weights and checkpoint names) over keys/values the caller holds,
    instead of the paged KV cache of the target's layers."""

    @property
    def nkv(self) -> int:
        return self.num_kv_heads

    @property
    def hd(self) -> int:
        return self.head_dim

    def project(self, positions: torch.Tensor, x: torch.Tensor):
        """x [T, H] at `positions` [T] -> query [T, heads, d], gate [T, heads * d], key and value [T, kv_heads, d]
        (q and k normed per head, then rotated)."""
        T, d = x.shape[0], self.head_dim
        query_gate, k, v = self.qkv_proj(x).split([2 * self.q_size, self.kv_size, self.kv_size], dim=-1)
        query_gate = query_gate.view(T, self.num_heads, 2 * d)
        q = self._rope(positions, self.q_norm(query_gate[..., :d]))
        k = self._rope(positions, self.k_norm(k.view(T, self.num_kv_heads, d)))
        return q, query_gate[..., d:].reshape(T, self.q_size), k, v.view(T, self.num_kv_heads, d)

    def attend(self, q: torch.Tensor, gate: torch.Tensor, k_ctx: torch.Tensor, v_ctx: torch.Tensor,
               ctx_visible: torch.Tensor, k_own: torch.Tensor | None, v_own: torch.Tensor | None) -> torch.Tensor:
        """One query row per request: q [R, heads, d] over its context rows k_ctx/v_ctx [R, C, kv_heads, d] (those
        with ctx_visible [R, C] true) and its own rows k_own/v_own [R, J, kv_heads, d] (all visible; None: none),
        in one softmax; the gated output [R, H]."""
        R, g, d = q.shape[0], self.num_heads // self.num_kv_heads, self.head_dim
        q = (q * self.scale).view(R, self.num_kv_heads, g, d)  # query head h reads key/value head h // g
        scores = torch.einsum("rkgd,rckd->rkgc", q, k_ctx).masked_fill(~ctx_visible[:, None, None, :], float("-inf"))
        C = scores.shape[-1]
        if k_own is not None:
            scores = torch.cat([scores, torch.einsum("rkgd,rjkd->rkgj", q, k_own)], dim=-1)
        p = scores.softmax(dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.einsum("rkgc,rckd->rkgd", p[..., :C], v_ctx)
        if v_own is not None:
            out = out + torch.einsum("rkgj,rjkd->rkgd", p[..., C:], v_own)
        return self.o_proj(out.reshape(R, self.q_size) * pointwise(torch.sigmoid, gate))


class Qwen3_5MTP(nn.Module):
    """The `mtp.*` head; parameter names are the checkpoint's without the `mtp.` prefix."""

    sliding_window = None  # attends over every kept position (the drafter KV cache reads this)

    def __init__(self, cfg: ModelConfig, make_mlp, max_positions: int):
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        rope = cfg.raw.get("rope_parameters") or {}
        partial = rope.get("partial_rotary_factor", cfg.raw.get("partial_rotary_factor", 0.25))
        self.rotary = RotaryEmbedding(int(cfg.head_dim * partial), cfg.rope_theta, max_positions, cfg.rope_scaling)
        self.fc = Linear(2 * h, h, bias=False)
        self.pre_fc_norm_embedding = ZeroCenteredRMSNorm(h, eps)
        self.pre_fc_norm_hidden = ZeroCenteredRMSNorm(h, eps)
        self.layers = nn.ModuleList([HybridDecoderLayer(cfg, MTPAttention(cfg, 0, self.rotary), make_mlp(cfg))])
        self.norm = ZeroCenteredRMSNorm(h, eps)

    # ---- the interface of the drafter KV cache (speculative/dflash_cache.py) ------------------------------
    def context(self, features: torch.Tensor) -> torch.Tensor:
        """features [..., 2H] = concat(embed(t_{i+1}), h_i) -> the layer input x_i [..., H]."""
        e, h = features.chunk(2, dim=-1)
        return self.fc(torch.cat([self.pre_fc_norm_embedding(e), self.pre_fc_norm_hidden(h)], dim=-1))

    def context_kv(self, ctx: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The layer's keys and values [n, kv_heads, d] of layer inputs ctx [n, H] at `positions` [n]."""
        layer = self.layers[0]
        _, _, k, v = layer.self_attn.project(positions, layer.input_layernorm(ctx))
        return [(k, v)]

    # ---- drafting --------------------------------------------------------------------------------------
    def draft(self, embed, lm_head, x: torch.Tensor, positions: torch.Tensor, k_ctx: torch.Tensor,
              v_ctx: torch.Tensor, visible: torch.Tensor, steps: int, pick=None) -> torch.Tensor:
        """`steps` drafts [R, steps] from layer inputs x [R, H] at `positions` [R] (the newest kept ones) over the
        kept context: draft j + 1 feeds the head its own output and draft j at position p + j. `pick(logits)`
        chooses each step's tokens (None: the argmax). One loop for the eager round and the captured one
        (speculative/mtp_graphs.py)."""
        own: list[tuple[torch.Tensor, torch.Tensor]] = []
        drafts = []
        for j in range(steps):
            y = self.draft_step(x, positions + j, k_ctx, v_ctx, visible, own, own_row=j > 0)
            logits = lm_head(y).float()
            token = logits.argmax(dim=-1) if pick is None else pick(logits)
            drafts.append(token)
            if j + 1 < steps:
                x = self.context(torch.cat([embed(token), y], dim=-1))
        return torch.stack(drafts, dim=1)

    def draft_step(self, x: torch.Tensor, positions: torch.Tensor, k_ctx: torch.Tensor, v_ctx: torch.Tensor,
                   ctx_visible: torch.Tensor, own: list[tuple[torch.Tensor, torch.Tensor]], own_row: bool):
        """One query row per request: layer input x [R, H] at `positions` [R], attending over its kept context
        (k_ctx/v_ctx [R, C, kv_heads, d], ctx_visible [R, C]) and the rows of its earlier draft steps (`own`,
        appended to when `own_row`: the row's keys/values are not in the context yet). Returns y [R, H]
        after the head's final norm."""
        layer = self.layers[0]
        attn = layer.self_attn
        q, gate, k, v = attn.project(positions, layer.input_layernorm(x))
        if own_row:
            own.append((k, v))
        k_own = torch.stack([kv[0] for kv in own], dim=1) if own else None
        v_own = torch.stack([kv[1] for kv in own], dim=1) if own else None
        mixed = attn.attend(q, gate, k_ctx, v_ctx, ctx_visible, k_own, v_own)
        h, residual = layer.post_attention_layernorm(mixed, x)
        return self.norm(layer.mlp(h), residual)[0]
