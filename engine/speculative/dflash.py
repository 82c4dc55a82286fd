"""DFlash-style block drafter: one forward pass proposes a whole block, conditioned on target features.

Architecture (config names as in public DFlash drafters: `dflash_config.{block_size, target_layer_ids,
mask_token_id}`, Qwen3-style layers):
  context = hidden_norm(fc(concat of the target's hidden states after layers target_layer_ids))
  block   = target_embed([last token, mask, mask, ...])          (block_size tokens)
  each drafter layer: queries from the block; keys/values from [context ; block] (q/k RMSNorm, RoPE
  at the tokens' absolute positions), attention non-causal; then a SwiGLU MLP.
  draft[j] = argmax / sample of target_lm_head(norm(h_block[j + 1])), j = 0..block_size-2
The target's features come from its own forward passes (the engine captures the chosen layers), so
the drafter never recomputes the target. Its own attention is recomputed over the context each
round (no drafter KV cache yet); `sliding_window` bounds that context when the config sets it.
Not implemented: the DFlash2 extras (grouped dynamic convolutions, candidate selector).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from onecat.engine.attention.sdpa import sdpa
from onecat.engine.errors import ConfigError, ModelNotFoundError
from onecat.engine.layers.mlp import GatedMLP
from onecat.engine.layers.norm import RMSNorm
from onecat.engine.layers.rotary import RotaryEmbedding
from onecat.engine.sampler import apply_filters, sample_from_probs
from onecat.engine.speculative.base import Proposer, hidden_state_tap


def dflash_value(cfg: dict, name: str, default=None):
    return (cfg.get("dflash_config") or {}).get(name, cfg.get(name, default))


class DFlashAttention(nn.Module):
    """Queries from the block; keys/values from [context ; block]; non-causal."""

    def __init__(self, cfg: dict):
        super().__init__()
        h, self.nh, self.nkv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
        self.hd = cfg.get("head_dim") or h // self.nh
        eps, bias = cfg.get("rms_norm_eps", 1e-6), cfg.get("attention_bias", False)
        self.q_proj = nn.Linear(h, self.nh * self.hd, bias=bias)
        self.k_proj = nn.Linear(h, self.nkv * self.hd, bias=bias)
        self.v_proj = nn.Linear(h, self.nkv * self.hd, bias=bias)
        self.o_proj = nn.Linear(self.nh * self.hd, h, bias=bias)
        self.q_norm, self.k_norm = RMSNorm(self.hd, eps), RMSNorm(self.hd, eps)

    def forward(self, hx: torch.Tensor, ctx: torch.Tensor, rotary: RotaryEmbedding, pos: torch.Tensor) -> torch.Tensor:
        B = hx.shape[0]
        kv_in = torch.cat([ctx, hx], dim=0)
        q = self.q_norm(self.q_proj(hx).view(B, self.nh, self.hd))
        k = self.k_norm(self.k_proj(kv_in).view(-1, self.nkv, self.hd))
        v = self.v_proj(kv_in).view(-1, self.nkv, self.hd)
        cos, sin = rotary.cos[pos].unsqueeze(1).to(q.dtype), rotary.sin[pos].unsqueeze(1).to(q.dtype)
        q = q * cos[-B:] + rotary._rotate_half(q) * sin[-B:]
        k = k * cos + rotary._rotate_half(k) * sin
        att = sdpa(q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0),
                   enable_gqa=self.nh != self.nkv)
        return self.o_proj(att[0].transpose(0, 1).reshape(B, -1))


class DFlashLayer(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        h, eps = cfg["hidden_size"], cfg.get("rms_norm_eps", 1e-6)
        self.self_attn = DFlashAttention(cfg)
        self.input_layernorm, self.post_attention_layernorm = RMSNorm(h, eps), RMSNorm(h, eps)
        self.mlp = GatedMLP(h, cfg["intermediate_size"])

    def forward(self, x: torch.Tensor, ctx: torch.Tensor, rotary: RotaryEmbedding, pos: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), ctx, rotary, pos)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDrafter(nn.Module):
    def __init__(self, cfg: dict, max_positions: int):
        super().__init__()
        self.cfg = cfg
        h = cfg["hidden_size"]
        self.target_layer_ids = list(dflash_value(cfg, "target_layer_ids") or [])
        if not self.target_layer_ids:
            raise ConfigError("DFlash drafter config needs dflash_config.target_layer_ids")
        self.block_size = int(dflash_value(cfg, "block_size", 16))
        self.mask_token_id = dflash_value(cfg, "mask_token_id")
        if self.mask_token_id is None:
            raise ConfigError("DFlash drafter config needs dflash_config.mask_token_id")
        self.sliding_window = cfg.get("sliding_window") if cfg.get("use_sliding_window") else None
        self.layers = nn.ModuleList(DFlashLayer(cfg) for _ in range(cfg["num_hidden_layers"]))
        self.norm = RMSNorm(h, cfg.get("rms_norm_eps", 1e-6))
        self.fc = nn.Linear(len(self.target_layer_ids) * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, cfg.get("rms_norm_eps", 1e-6))
        theta = cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        self.rotary = RotaryEmbedding(cfg.get("head_dim") or h // cfg["num_attention_heads"], theta, max_positions,
                                      None)

    def forward(self, block_embeds: torch.Tensor, features: torch.Tensor, start: int) -> torch.Tensor:
        """block_embeds [B, H] at positions start..start+B-1; features [C, L*H] at positions start-C..start-1."""
        ctx = self.hidden_norm(self.fc(features))
        C, B = ctx.shape[0], block_embeds.shape[0]
        pos = torch.arange(start - C, start + B, device=block_embeds.device)
        x = block_embeds
        for layer in self.layers:
            x = layer(x, ctx, self.rotary, pos)
        return self.norm(x)


def load_drafter(path: str | Path, target, dtype: torch.dtype, device: torch.device) -> DFlashDrafter:
    path = Path(path)
    if not (path / "config.json").is_file():
        raise ModelNotFoundError(f"DFlash drafter directory {path} has no config.json")
    cfg = json.loads((path / "config.json").read_text())
    if cfg["hidden_size"] != target.model_config.hidden_size:
        raise ConfigError(f"drafter hidden_size {cfg['hidden_size']} != target hidden_size "
                          f"{target.model_config.hidden_size}; the drafter belongs to another target")
    bad = [i for i in dflash_value(cfg, "target_layer_ids") or [] if not 0 <= i < target.model_config.num_hidden_layers]
    if bad:
        raise ConfigError(f"drafter target_layer_ids {bad} are outside the target's "
                          f"{target.model_config.num_hidden_layers} layers")
    drafter = DFlashDrafter(cfg, target.max_model_len + 64)
    state = {}
    for f in sorted(path.glob("*.safetensors")):
        state.update(load_file(str(f)))
    state = {k.removeprefix("model."): v for k, v in state.items()}
    for key in [k for k in state if k.endswith("mlp.gate_proj.weight")]:  # checkpoints keep gate/up apart
        up = key.replace("gate_proj", "up_proj")
        state[key.replace("gate_proj", "gate_up_proj")] = torch.cat([state.pop(key), state.pop(up)], dim=0)
    missing, unexpected = drafter.load_state_dict(state, strict=False)
    missing = [m for m in missing if not m.startswith("rotary")]
    if missing or unexpected:
        raise ConfigError(f"DFlash drafter weights do not match its config: missing {missing[:4]}, "
                          f"unexpected {unexpected[:4]}")
    drafter.rotary.build_tables(device)
    return drafter.to(device=device, dtype=dtype).eval()


class DFlashProposer(Proposer):
    name = "dflash"

    def __init__(self, k: int, target, model: str):
        self.drafter = load_drafter(model, target, target.dtype, target.device)
        super().__init__(min(k, self.drafter.block_size - 1))
        self.model_name = model
        self.target_model = target.model
        self.tap = hidden_state_tap(target.model)
        self.tap.aux_layer_ids = list(self.drafter.target_layer_ids)
        self.features: dict[str, torch.Tensor] = {}

    def record_features(self, seq, rows: torch.Tensor) -> None:
        old = self.features.get(seq.request_id)
        feats = rows if old is None else torch.cat([old, rows], dim=0)
        window = self.drafter.sliding_window
        self.features[seq.request_id] = feats[-window:] if window else feats

    @torch.inference_mode()
    def propose(self, seqs, budgets):
        out = []
        embed = self.target_model.embed_tokens
        for seq, budget in zip(seqs, budgets):
            feats = self.features.get(seq.request_id)
            if feats is None or feats.shape[0] == 0:
                out.append(([], None))
                continue
            n = min(budget, self.k)
            block = torch.tensor([seq.token_ids[-1]] + [self.drafter.mask_token_id] * n, device=feats.device)
            h = self.drafter(embed(block), feats, seq.num_tokens - 1)
            logits = self.target_model.compute_logits(h[1:]).float()
            if seq.params.greedy:
                out.append((logits.argmax(dim=-1).tolist(), None))
            else:
                q = apply_filters(logits, [seq.params] * n)
                out.append(([sample_from_probs(q[j], seq.generator) for j in range(n)], q))
        return out

    def release(self, seq) -> None:
        self.features.pop(seq.request_id, None)

    def describe(self) -> dict:
        return {"method": self.name, "num_speculative_tokens": self.k, "model": self.model_name,
                "block_size": self.drafter.block_size, "target_layer_ids": self.drafter.target_layer_ids}
