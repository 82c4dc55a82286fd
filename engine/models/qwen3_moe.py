"""Qwen3-MoE: the Qwen3 decoder (q/k norm) whose feed-forward is a sparse mixture of experts in the layers
the config marks (every `decoder_sparse_step`-th layer not in `mlp_only_layers`), a dense MLP elsewhere."""
from __future__ import annotations

from collections.abc import Iterable

import torch

from onecat.engine.config import ModelConfig
from onecat.engine.errors import UnsupportedModelError
from onecat.engine.layers.moe import SparseMoE
from onecat.engine.models.llama import LlamaForCausalLM
from onecat.engine.models.weight_loading import fused_route, load_by_name


def moe_settings(cfg: ModelConfig) -> dict:
    """The MoE sizes from the HF config (`num_experts`, or its alias `num_local_experts`)."""
    raw = cfg.raw
    num_experts = raw.get("num_experts") or raw.get("num_local_experts")
    if not num_experts or not raw.get("moe_intermediate_size") or not raw.get("num_experts_per_tok"):
        raise UnsupportedModelError("an MoE config needs num_experts, num_experts_per_tok and moe_intermediate_size")
    if raw.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"hidden_act {raw['hidden_act']!r} is not supported in MoE experts; only silu")
    return dict(hidden=cfg.hidden_size, intermediate=raw["moe_intermediate_size"], num_experts=num_experts,
                top_k=raw["num_experts_per_tok"])


def is_sparse_layer(cfg: ModelConfig, i: int) -> bool:
    raw = cfg.raw
    step = raw.get("decoder_sparse_step", 1) or 1
    return i not in (raw.get("mlp_only_layers") or []) and (i + 1) % step == 0


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    qk_norm = True

    def __init__(self, cfg: ModelConfig, max_positions: int):
        super().__init__(cfg, max_positions)
        settings = moe_settings(cfg)
        norm_topk = bool(cfg.raw.get("norm_topk_prob", False))
        for i, layer in enumerate(self.layers):
            if is_sparse_layer(cfg, i):
                layer.mlp = SparseMoE(**settings, norm_topk_prob=norm_topk)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_by_name(self, weights, fused_route(self))
