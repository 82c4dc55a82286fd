"""Qwen3.5 and Qwen3.5-MoE (text): hybrid decoders whose layers are, per the config's `layer_types`, Gated
DeltaNet linear attention (a per-request recurrent state) or gated full attention (paged KV), each followed
by a dense SwiGLU MLP (Qwen3.5) or a sparse MoE with a gated shared expert (Qwen3.5-MoE). Norms are
zero-centered RMSNorms.

The engine gives a hybrid model one recurrent-state slot per running request (`allocate_recurrent_state`,
`Sequence.state_slot`); only the full-attention layers have KV caches (ModelConfig.kv_layer_ids). A step's
slots come as a list (eager steps: the state cache plans the step on the host) or, in a decode or verify step
replayed from a CUDA graph, as a device tensor the graph runner fills before each replay, with each verify
row's padding in another (engine/worker/cuda_graph.py).
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from onecat.engine.attention.forward_context import get_forward_context
from onecat.engine.cache.recurrent_state import RecurrentStateCache, StatePlan
from onecat.engine.config import ModelConfig
from onecat.engine.layers.gated_attention import GatedAttention
from onecat.engine.layers.gated_deltanet import GatedDeltaNet, delta_rows, linear_attention_sizes
from onecat.engine.layers.linear import Linear
from onecat.engine.layers.mlp import GatedMLP
from onecat.engine.layers.moe import SparseMoE
from onecat.engine.layers.qwen3_5_norms import ZeroCenteredRMSNorm
from onecat.engine.layers.rotary import RotaryEmbedding
from onecat.engine.models.llama import tapped_layers
from onecat.engine.models.qwen3_moe import moe_settings
from onecat.engine.models.weight_loading import fused_route, load_by_name


class HybridDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, mixer: nn.Module, mlp: nn.Module):
        super().__init__()
        self.input_layernorm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if isinstance(mixer, GatedDeltaNet):
            self.linear_attn = mixer
        else:
            self.self_attn = mixer
        self.post_attention_layernorm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = mlp

    def forward(self, positions: torch.Tensor, h: torch.Tensor, residual: torch.Tensor | None, plan: StatePlan,
                keep_input: list[torch.Tensor] | None = None):
        """(this layer's MLP output, the residual stream before it), as the Llama layers return them (and
        `keep_input` as they keep it)."""
        if residual is None:
            residual, h = h, self.input_layernorm(h)
        else:
            h, residual = self.input_layernorm(h, residual)
        if keep_input is not None:
            keep_input.append(residual)
        mixed = self.linear_attn(h, plan) if hasattr(self, "linear_attn") else self.self_attn(positions, h)
        h, residual = self.post_attention_layernorm(mixed, residual)
        return self.mlp(h), residual


class Qwen3_5ForCausalLM(nn.Module):
    """Weights are named as in HF checkpoints (a `model.language_model.` prefix is read as `model.`); q/k/v and
    the DeltaNet input projections are fused on load."""

    aux_layer_ids: list[int] = []  # layers whose outputs a feature-conditioned drafter (DFlash) reads
    aux_hidden: torch.Tensor | None = None  # [T, len(aux_layer_ids) * hidden] from the last forward

    def __init__(self, cfg: ModelConfig, max_positions: int):
        super().__init__()
        self.cfg = cfg
        rope = cfg.raw.get("rope_parameters") or {}
        partial = rope.get("partial_rotary_factor", cfg.raw.get("partial_rotary_factor", 0.25))
        rotary = RotaryEmbedding(int(cfg.head_dim * partial), cfg.rope_theta, max_positions, cfg.rope_scaling)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        layers, kv_index, state_index = [], 0, 0
        for kind in cfg.layer_types:
            if kind == "linear_attention":
                mixer = GatedDeltaNet(cfg, state_index)
                state_index += 1
            else:
                mixer = GatedAttention(cfg, kv_index, rotary)
                kv_index += 1
            layers.append(HybridDecoderLayer(cfg, mixer, self.make_mlp(cfg)))
        self.layers = nn.ModuleList(layers)
        self.num_linear_layers = state_index
        self.norm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.states: RecurrentStateCache | None = None

    @staticmethod
    def make_mlp(cfg: ModelConfig) -> nn.Module:
        return GatedMLP(cfg.hidden_size, cfg.intermediate_size)

    # ---- recurrent state ----------------------------------------------------------------------------------
    def allocate_recurrent_state(self, num_slots: int, dtype: torch.dtype, device: torch.device,
                                 num_snapshots: int = 0) -> None:
        """One state slot per request that may run at once (the engine's max_num_seqs), and `num_snapshots` saved
        states for prefix caching (mamba_cache_mode align); sized by the layers' (local) heads."""
        s = linear_attention_sizes(self.cfg)
        mixer = next((m for m in self.modules() if isinstance(m, GatedDeltaNet)), None)
        if mixer is not None:  # this rank's heads under tensor parallel (engine/parallel/hybrid_sharding.py)
            s.update(conv_dim=mixer.conv_dim, v_heads=mixer.v_heads, k_heads=mixer.k_heads)
        self.states = RecurrentStateCache(self.num_linear_layers, num_slots, s["conv_dim"], s["conv_kernel"],
                                          s["v_heads"], s["k_dim"], s["v_dim"], dtype, device, num_snapshots,
                                          k_heads=s["k_heads"], recurrence=delta_rows)

    # ---- forward ------------------------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if self.states is None:
            raise RuntimeError("allocate_recurrent_state before running a hybrid model")
        ctx = get_forward_context()
        if isinstance(ctx.state_slots, torch.Tensor):  # a CUDA graph's step: the rows' slots on the device
            if ctx.state_leads is None:  # decode
                plan = self.states.decode_plan(ctx.state_slots)
            else:  # verify: rows of equal width, each request's own tokens behind its padding
                plan = self.states.verify_plan(ctx.state_slots, ctx.state_leads,
                                               input_ids.shape[0] // ctx.state_slots.shape[0])
        else:
            plan = self.states.step_plan(ctx.meta.query_lens_cpu, ctx.meta.seq_lens_cpu, ctx.state_slots,
                                         ctx.lookaheads)
        h, residual = self.embed_tokens(input_ids), None
        taps = []  # the tapped layers' outputs, as the next norm forms them (llama.py tapped_layers)
        tapped = self.aux_layer_ids
        for i, layer in enumerate(self.layers):
            h, residual = layer(positions, h, residual, plan, taps if (i - 1) in tapped else None)
        normed, total = self.norm(h, residual)
        self.aux_hidden = tapped_layers(taps, total, (len(self.layers) - 1) in tapped)
        return normed

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def greedy_tokens(self, logits: torch.Tensor) -> torch.Tensor:
        return logits.argmax(dim=-1)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_by_name(self, weights, fused_route(self, prefixes=("model.language_model.", "model."),
                                                 skip=("rotary_emb", "mtp.", "visual.")))


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):
    """Qwen3.5 with a sparse MoE (top-k renormalized) plus a sigmoid-gated shared expert in every layer."""

    @staticmethod
    def make_mlp(cfg: ModelConfig) -> nn.Module:
        return SparseMoE(**moe_settings(cfg), norm_topk_prob=True,
                         shared_intermediate=cfg.raw.get("shared_expert_intermediate_size") or 0)
