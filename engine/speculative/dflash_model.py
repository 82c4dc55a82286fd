"""DFlash-style block drafter: one forward pass proposes a whole block, conditioned on target features.

Architecture (config names as in public DFlash drafters: `dflash_config.{block_size, target_layer_ids,
mask_token_id}`, Qwen3-style layers):
  context = hidden_norm(fc(concat of the target's hidden states after layers target_layer_ids))
  block   = target_embed([last token, mask, mask, ...])          (block_size tokens)
  each drafter layer: queries from the block; keys/values from [context ; block] (q/k RMSNorm, RoPE
  at the tokens' absolute positions), attention non-causal; then a SwiGLU MLP.
  draft[j] = argmax / sample of target_lm_head(norm(h_block[j + 1])), j = 0..block_size-2
The target's features come from its own forward passes (the engine captures the chosen layers), so
the drafter never recomputes the target. The context's per-layer keys/values are kept per request
(dflash_cache.py): each round projects only the new feature rows; `sliding_window` bounds the context
when the config sets it. `forward_blocks` is the one entry point of the math for inference and training.
Hybrid targets (Qwen3.5, Qwen3.5-MoE) tap the same way, DeltaNet and attention layers alike. A verify pass's row
of a token depends only on the tokens up to it (the recurrent layers run a verify chunk token by token), so the
rows of the accepted drafts that the engine keeps are exactly those a plain decode would give, whatever was
rejected after them; the recurrent state itself is rolled back by its cache.
Not implemented: the DFlash2 extras (grouped dynamic convolutions, candidate selector).
The model and its loading live here; the proposer that drafts with it is dflash.py.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from onecat.engine.errors import ConfigError, ModelNotFoundError
from onecat.engine.layers.linear import Linear, project
from onecat.engine.layers.mlp import GatedMLP
from onecat.engine.layers.norm import RMSNorm
from onecat.engine.layers.rotary import RotaryEmbedding
from onecat.engine.speculative.dflash_fused import forward_fused, fused_forward_applies

def dflash_value(cfg: dict, name: str, default=None):
    return (cfg.get("dflash_config") or {}).get(name, cfg.get(name, default))


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE (half-split) of x [..., T, heads, D] with cos/sin [..., T, D] of the rows' positions."""
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    return x * cos + RotaryEmbedding._rotate_half(x) * sin


class DFlashAttention(nn.Module):
    """Queries from the block rows; keys/values from [visible context rows ; the whole block]; non-causal.

    The context's keys/values depend only on the context (`context_kv`), so a runtime can keep them
    per request and project only new rows."""

    def __init__(self, cfg: dict):
        super().__init__()
        h, self.nh, self.nkv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
        self.hd = cfg.get("head_dim") or h // self.nh
        self.scale = self.hd ** -0.5
        eps, bias = cfg.get("rms_norm_eps", 1e-6), cfg.get("attention_bias", False)
        self.q_proj = Linear(h, self.nh * self.hd, bias=bias)
        self.k_proj = Linear(h, self.nkv * self.hd, bias=bias)
        self.v_proj = Linear(h, self.nkv * self.hd, bias=bias)
        self.o_proj = Linear(self.nh * self.hd, h, bias=bias)
        self.q_norm, self.k_norm = RMSNorm(self.hd, eps), RMSNorm(self.hd, eps)

    def project_kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [..., T, H] -> keys (k_norm, RoPE) and values, each [..., T, nkv, hd]."""
        shape = (*x.shape[:-1], self.nkv, self.hd)
        k = rotate(self.k_norm(self.k_proj(x).view(shape)), cos, sin)
        return k, self.v_proj(x).view(shape)

    def forward(self, hx: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_ctx: torch.Tensor,
                v_ctx: torch.Tensor, ctx_visible: torch.Tensor) -> torch.Tensor:
        """hx [R, B, H] (normed block rows), cos/sin [R, B, hd]; k_ctx/v_ctx [S, C, nkv, hd], ctx_visible
        [R, C] bool. S contexts serve the R rows in S groups of R // S consecutive rows (S = R: one context
        per row, as in batched drafting; S = 1: one shared context; training packs several sequences).
        A group's queries meet its context in one matmul (a context is never copied per row); scores
        against the context and against the row's own block share one softmax."""
        R, B, _ = hx.shape
        S, C = k_ctx.shape[0], k_ctx.shape[1]
        if R % S:
            raise ValueError(f"{R} block rows cannot be split into {S} context groups")
        A, g = R // S, self.nh // self.nkv
        q = rotate(self.q_norm(self.q_proj(hx).view(R, B, self.nh, self.hd)), cos, sin)
        k_blk, v_blk = self.project_kv(hx, cos, sin)
        # [R, B, nkv, g, hd] -> [R, nkv, g*B, hd]: query head h reads key/value head h // g (GQA)
        q = (q * self.scale).view(R, B, self.nkv, g, self.hd).permute(0, 2, 3, 1, 4).reshape(R, self.nkv, g * B, -1)
        q_grouped = q.view(S, A, self.nkv, g * B, self.hd).transpose(1, 2).reshape(S, self.nkv, A * g * B, -1)
        s_ctx = torch.matmul(q_grouped, k_ctx.permute(0, 2, 3, 1))  # [S, nkv, A*g*B, C]
        s_ctx = s_ctx.view(S, self.nkv, A, g * B, C).transpose(1, 2).reshape(R, self.nkv, g * B, C)
        s_ctx = s_ctx.masked_fill(~ctx_visible[:, None, None, :], float("-inf"))
        s_blk = torch.matmul(q, k_blk.permute(0, 2, 3, 1))
        p = torch.cat([s_ctx, s_blk], dim=-1).softmax(dim=-1, dtype=torch.float32).to(q.dtype)
        p_ctx = p[..., :C].reshape(S, A, self.nkv, g * B, C).transpose(1, 2).reshape(S, self.nkv, A * g * B, C)
        out_ctx = torch.matmul(p_ctx, v_ctx.transpose(1, 2))  # [S, nkv, A*g*B, hd]
        out_ctx = out_ctx.view(S, self.nkv, A, g * B, self.hd).transpose(1, 2).reshape(R, self.nkv, g * B, -1)
        out = out_ctx + torch.matmul(p[..., C:], v_blk.transpose(1, 2))
        out = out.view(R, self.nkv, g, B, self.hd).permute(0, 3, 1, 2, 4).reshape(R, B, self.nh * self.hd)
        return self.o_proj(out)


class DFlashLayer(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        h, eps = cfg["hidden_size"], cfg.get("rms_norm_eps", 1e-6)
        self.self_attn = DFlashAttention(cfg)
        self.input_layernorm, self.post_attention_layernorm = RMSNorm(h, eps), RMSNorm(h, eps)
        self.mlp = GatedMLP(h, cfg["intermediate_size"])

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_ctx: torch.Tensor,
                v_ctx: torch.Tensor, ctx_visible: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, k_ctx, v_ctx, ctx_visible)
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
        self.fc = Linear(len(self.target_layer_ids) * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, cfg.get("rms_norm_eps", 1e-6))
        theta = cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        self.rotary = RotaryEmbedding(cfg.get("head_dim") or h // cfg["num_attention_heads"], theta, max_positions,
                                      None)

    def rope(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [..., D] of absolute positions `pos` [...], in the drafter's dtype."""
        dtype = self.norm.weight.dtype
        return self.rotary.cos[pos].to(dtype), self.rotary.sin[pos].to(dtype)

    def context(self, features: torch.Tensor) -> torch.Tensor:
        """[..., C, len(target_layer_ids) * H] target features -> [..., C, H] = hidden_norm(fc(features))."""
        return self.hidden_norm(self.fc(features))

    def context_kv(self, ctx: torch.Tensor, ctx_pos: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per drafter layer, the keys (after k_norm and RoPE at `ctx_pos`) and values of the context rows:
        ctx [S, C, H] -> [(k, v)] each [S, C, nkv, hd]. Depends only on the context. Where no gradient is
        wanted (drafting), every layer's K and V projections run as one matmul and the norms and RoPE as one
        pass over all layers (a few kernels a round instead of a dozen per layer; equal to the per-layer path
        to rounding; a drafter quantized at load runs its stacked packed layer, drafter_quant.py); training takes
        the per-layer path, whose gradients reach each projection."""
        kv = self._context_kv_rows(ctx, ctx_pos)
        if kv is None:
            cos, sin = self.rope(ctx_pos)
            return [layer.self_attn.project_kv(ctx, cos, sin) for layer in self.layers]
        return [(kv[..., i, 0, :, :], kv[..., i, 1, :, :]) for i in range(len(self.layers))]

    def context_kv_stacked(self, ctx: torch.Tensor, ctx_pos: torch.Tensor) -> torch.Tensor:
        """`context_kv` of ctx [n, H] at positions [n] as one tensor [layers, 2, n, nkv, hd] (the drafter cache's
        layout): one layout copy from the stacked projection, not a stack of every layer's views."""
        kv = self._context_kv_rows(ctx, ctx_pos)
        if kv is None:
            return torch.stack([torch.stack(pair) for pair in self.context_kv(ctx, ctx_pos)])
        return kv.permute(1, 2, 0, 3, 4).contiguous()

    def _context_kv_rows(self, ctx: torch.Tensor, ctx_pos: torch.Tensor) -> torch.Tensor | None:
        """Every layer's context K (normed, rotated) and V from one stacked projection: [..., C, layers, 2, nkv,
        hd]; None where the per-layer path runs (training, projections that are not plain Linears). The k norm
        and RoPE run in place: by the fused kernel, one launch a layer, where the drafter's fused kernels run, else
        in torch ops over all layers at once."""
        attn = self.layers[0].self_attn
        packed = getattr(self, "kv_packed", None)
        if torch.is_grad_enabled() or (packed is None and not isinstance(attn.k_proj, nn.Linear)):
            return None
        if packed is not None:
            kv, norm_weight = packed(ctx), self.kv_packed_norm
        else:
            weight, bias, norm_weight = self._stacked_kv_weights()
            kv = project(ctx, weight, bias, False, owner=self)  # float32 on CPU: the rows kernel
        layers, nkv, hd = len(self.layers), attn.nkv, attn.hd
        kv = kv.view(*ctx.shape[:-1], layers, 2, nkv, hd)
        if attn.k_norm.use_fused:  # Triton (CUDA, or its interpreter in tests)
            from onecat.engine.kernels.triton_fused import qk_rope_cache

            rows = kv.view(-1, layers, 2 * nkv * hd)
            pos = ctx_pos.expand(ctx.shape[:-1]).reshape(-1)
            for i in range(layers):  # no q heads: each (row, layer)'s k heads normed and rotated in place
                qk_rope_cache(rows[:, i], pos, self.rotary.cos, self.rotary.sin, 0, nkv, hd, None, None, None,
                              norm_weight[i], norm_weight[i], attn.k_norm.eps)
            return kv
        cos, sin = self.rope(ctx_pos)
        k = kv.select(-3, 0)  # [..., C, layers, nkv, hd]
        normed = RMSNorm.normalize(k, norm_weight[:, None, :], attn.k_norm.eps)
        cos, sin = cos[..., None, None, :], sin[..., None, None, :]
        k.copy_(normed * cos + RotaryEmbedding._rotate_half(normed) * sin)
        return kv

    def _stacked_kv_weights(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """Every layer's [k_proj; v_proj] weights (and biases) stacked, and the k_norm weights [layers, hd];
        rebuilt whenever a weight was replaced or changed in place (loading, training steps)."""
        params = [t for layer in self.layers for t in (layer.self_attn.k_proj.weight, layer.self_attn.v_proj.weight,
                                                         layer.self_attn.k_norm.weight)]
        key = tuple((t.data_ptr(), t._version) for t in params)
        if getattr(self, "_stacked_key", None) != key:
            projections = [m for layer in self.layers for m in (layer.self_attn.k_proj, layer.self_attn.v_proj)]
            bias = None if projections[0].bias is None else torch.cat([m.bias for m in projections])
            self._stacked = (torch.cat([m.weight for m in projections]), bias,
                             torch.stack([layer.self_attn.k_norm.weight for layer in self.layers]))
            self._stacked_key = key
        return self._stacked

    def forward_blocks(self, block_embeds: torch.Tensor, block_pos: torch.Tensor, ctx: torch.Tensor,
                       ctx_pos: torch.Tensor, ctx_len: torch.Tensor) -> torch.Tensor:
        """block_embeds [R, B, H] at absolute positions block_pos [R, B]; ctx [S, C, H] (from `context`)
        at ctx_pos [S or 1, C]: S contexts for S groups of R // S consecutive rows (S == R: one each; S == 1:
        shared); row r sees the first ctx_len[r] rows of its group's context and its whole block.
        Returns [R, B, H] after the final norm; draft j is lm_head(out[:, j + 1])."""
        return self.forward_cached(block_embeds, block_pos, self.context_kv(ctx, ctx_pos), ctx_len)

    def forward_cached(self, block_embeds: torch.Tensor, block_pos: torch.Tensor,
                       layer_kv: list[tuple[torch.Tensor, torch.Tensor]], ctx_len: torch.Tensor) -> torch.Tensor:
        """`forward_blocks` from context keys/values already projected (`context_kv`, or a runtime cache);
        through the fused kernels where they apply (dflash_fused.py: drafting on a GPU)."""
        if layer_kv and fused_forward_applies(self, block_embeds, layer_kv[0][0].shape[0]):
            return forward_fused(self, block_embeds, block_pos, layer_kv, ctx_len)
        C = layer_kv[0][0].shape[1] if layer_kv else 0
        ctx_visible = torch.arange(C, device=ctx_len.device) < ctx_len.unsqueeze(1)
        cos, sin = self.rope(block_pos)
        x = block_embeds
        for layer, (k_ctx, v_ctx) in zip(self.layers, layer_kv):
            x = layer(x, cos, sin, k_ctx, v_ctx, ctx_visible)
        return self.norm(x)

    def forward(self, block_embeds: torch.Tensor, features: torch.Tensor, start: int) -> torch.Tensor:
        """One request: block_embeds [B, H] at positions start..start+B-1; features [C, L*H] at start-C..start-1."""
        C, B = features.shape[0], block_embeds.shape[0]
        dev = block_embeds.device
        ctx_pos = torch.arange(start - C, start, device=dev).unsqueeze(0)
        block_pos = torch.arange(start, start + B, device=dev).unsqueeze(0)
        return self.forward_blocks(block_embeds.unsqueeze(0), block_pos, self.context(features).unsqueeze(0),
                                   ctx_pos, torch.tensor([C], device=dev))[0]


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
    drafter = DFlashDrafter(cfg, target.max_model_len + int(dflash_value(cfg, "block_size", 16)))
    load_drafter_weights(drafter, path)
    drafter = drafter.to(device=device, dtype=dtype).eval()
    drafter.rotary.build_tables(device)  # float32 tables (`to` cast them): the fused RoPE kernel reads them so
    return drafter


def load_drafter_weights(drafter: DFlashDrafter, path: Path) -> None:
    """Load the safetensors of drafter directory `path` into `drafter` (checkpoint names: an optional
    `model.` prefix, gate/up projections apart); a ConfigError when they do not fit its config."""
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
        raise ConfigError(f"DFlash drafter weights in {path} do not match its config: missing {missing[:4]}, "
                          f"unexpected {unexpected[:4]}")
