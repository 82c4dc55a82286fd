"""A random-weight DFlash drafter of the published shape for a target: the compute a trained drafter
would cost, for acceptance-controlled measurements (synthetic.py) on targets without a trained one.

Shape: the target's width, attention heads, head size and MLP width (an MoE target's drafter takes four
times the width, a dense MLP), DRAFTER_LAYERS layers, the given block size, five tapped target layers
spread over its depth (DFlash's published drafters tap five). Weights N(0, 0.02^2), norms one; written once
into the onecat cache, keyed by the shape.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from onecat.engine.config import ModelConfig
from onecat.engine.kernels.cache import cache_root

DRAFTER_LAYERS = 5


def drafter_config(target: ModelConfig, block_size: int) -> dict:
    n, h = target.num_hidden_layers, target.hidden_size
    taps = sorted({min(1, n - 1), n // 4, n // 2, 3 * n // 4, max(n - 2, 0)})
    return {"architectures": ["DFlashDraftModel"], "hidden_size": h,
            "intermediate_size": target.intermediate_size or 4 * h,
            "num_attention_heads": target.num_attention_heads, "num_key_value_heads": target.num_key_value_heads,
            "head_dim": target.head_dim, "rms_norm_eps": target.rms_norm_eps, "rope_theta": target.rope_theta,
            "vocab_size": target.vocab_size, "num_hidden_layers": DRAFTER_LAYERS,
            "dflash_config": {"block_size": block_size, "target_layer_ids": taps, "mask_token_id": 0}}


def random_dflash_drafter(target: ModelConfig, block_size: int) -> Path:
    """The drafter's folder (config.json + model.safetensors)."""
    from safetensors.torch import save_file

    cfg = drafter_config(target, block_size)
    text = json.dumps(cfg, sort_keys=True)
    folder = cache_root() / "random-drafters" / f"dflash-{hashlib.sha256(text.encode()).hexdigest()[:12]}"
    if (folder / "model.safetensors").is_file():
        return folder
    h, inter, hd = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    g = torch.Generator().manual_seed(0)

    def rnd(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    def ones(size: int) -> torch.Tensor:
        return torch.ones(size, dtype=torch.bfloat16)

    taps = len(cfg["dflash_config"]["target_layer_ids"])
    state = {"fc.weight": rnd(h, taps * h), "hidden_norm.weight": ones(h), "norm.weight": ones(h)}
    for i in range(DRAFTER_LAYERS):
        p = f"layers.{i}."
        for name, shape in (("self_attn.q_proj", (q, h)), ("self_attn.k_proj", (kv, h)), ("self_attn.v_proj", (kv, h)),
                            ("self_attn.o_proj", (h, q)), ("mlp.gate_proj", (inter, h)), ("mlp.up_proj", (inter, h)),
                            ("mlp.down_proj", (h, inter))):
            state[p + name + ".weight"] = rnd(*shape)
        for name, size in (("input_layernorm", h), ("post_attention_layernorm", h), ("self_attn.q_norm", hd),
                           ("self_attn.k_norm", hd)):
            state[p + name + ".weight"] = ones(size)
    tmp = folder.with_name(folder.name + ".partial")
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "config.json").write_text(text)
    save_file(state, str(tmp / "model.safetensors"))
    if not folder.exists():  # another process may have written it first
        tmp.replace(folder)
    return folder
