"""Llama-family decoder (also the base for Qwen2/Qwen3): forward takes (input_ids, positions)."""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from onecat.engine.config import ModelConfig
from onecat.engine.core.sampler import greedy_on_device
from onecat.engine.errors import CorruptModelError
from onecat.engine.layers.attention import SelfAttention
from onecat.engine.layers.linear import Linear, norm_then_linear
from onecat.engine.layers.mlp import GatedMLP
from onecat.engine.layers.norm import RMSNorm
from onecat.engine.layers.rotary import RotaryEmbedding


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, idx: int, rotary: RotaryEmbedding, qk_norm: bool):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = SelfAttention(cfg, idx, rotary, qk_norm)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, positions: torch.Tensor, h: torch.Tensor, residual: torch.Tensor | None,
                keep_input: list[torch.Tensor] | None = None):
        """Returns (this layer's MLP output, the residual stream before it); their sum is the layer's
        output. Keeping them apart lets each residual add fuse into the next RMSNorm (and, at one
        token, that norm into the projection after it). `keep_input` gets the sum this layer's input norm
        forms, the previous layer's output (a drafter's tap: no add of its own)."""
        attn = self.self_attn
        if residual is None:
            residual = h
            qkv = attn.qkv_proj(self.input_layernorm(h))
        else:
            qkv, residual = norm_then_linear(self.input_layernorm, attn.qkv_proj, h, residual)
        if keep_input is not None:
            keep_input.append(residual)
        return self.mlp.after_norm(self.post_attention_layernorm, attn(positions, qkv), residual)


def tapped_layers(taps: list[torch.Tensor], last: torch.Tensor, last_tapped: bool) -> torch.Tensor | None:
    """[T, tapped layers * hidden]: each tapped layer's output side by side, in layer order. A layer's output
    h + residual is the sum the next layer's input norm forms (`keep_input`), or the final norm's for the last
    layer, so a tap adds no kernel of its own."""
    if last_tapped:
        taps.append(last)
    return torch.cat(taps, dim=-1) if taps else None


class LlamaForCausalLM(nn.Module):
    """Weights are named as in HF checkpoints, except q/k/v and gate/up, which are fused on load."""

    qk_norm = False

    def __init__(self, cfg: ModelConfig, max_positions: int):
        super().__init__()
        self.cfg = cfg
        rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, max_positions, cfg.rope_scaling)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, rotary, self.qk_norm) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    aux_layer_ids: list[int] = []  # layers whose outputs a feature-conditioned drafter (DFlash) reads
    aux_hidden: torch.Tensor | None = None  # [T, len(aux_layer_ids) * hidden] from the last forward

    cpu_decode = None  # runs a batch-1 decode step's layers in one C++ call (llama_cpu_decode.py), when on

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        tapped = self.aux_layer_ids
        one_call = self.cpu_decode(h, positions, tapped) if self.cpu_decode is not None else None
        if one_call is not None:
            h, residual, taps = one_call
        else:
            residual = None
            taps = []  # the tapped layers' outputs, as the next norm forms them (tapped_layers)
            for i, layer in enumerate(self.layers):
                h, residual = layer(positions, h, residual, taps if (i - 1) in tapped else None)
        normed, total = self.norm(h, residual)
        self.aux_hidden = tapped_layers(list(taps), total, (len(self.layers) - 1) in tapped)
        return normed

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def greedy_tokens(self, logits: torch.Tensor) -> torch.Tensor:
        """Row-wise argmax of the logits (first index on ties), by the fused kernels where they are on."""
        return greedy_on_device(logits) if getattr(self.lm_head, "use_fused", False) else logits.argmax(dim=-1)

    # ---- loading ------------------------------------------------------------------------------
    _FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
              "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def _shard_offset(self, fused: str, shard: int) -> tuple[int, int]:
        c = self.cfg
        if fused == "qkv_proj":
            q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
            return [(0, q), (q, kv), (q + kv, kv)][shard]
        return (shard * c.intermediate_size, c.intermediate_size)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[str] = set()
        for name, tensor in weights:
            if name.startswith("model."):
                name = name[len("model."):]
            if "rotary_emb" in name:
                continue
            if name == "lm_head.weight" and self.cfg.tie_word_embeddings:
                continue
            parts = name.split(".")
            target, rows = name, None
            if len(parts) >= 2 and parts[-2] in self._FUSED:
                fused, shard = self._FUSED[parts[-2]]
                target = ".".join(parts[:-2] + [fused, parts[-1]])
                rows = self._shard_offset(fused, shard)
            param = params.get(target)
            if param is None:
                raise CorruptModelError(f"checkpoint tensor {name!r} has no place in {type(self).__name__}")
            dst = param.data if rows is None else param.data.narrow(0, rows[0], rows[1])
            if tuple(dst.shape) != tuple(tensor.shape):
                raise CorruptModelError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                                        f"expected {tuple(dst.shape)}; config and weights disagree")
            dst.copy_(tensor)
            loaded.add(f"{target}#{rows}")
        expected = {n for n, _ in self.named_parameters()}
        got = {k.split("#")[0] for k in loaded}
        if self.cfg.tie_word_embeddings:
            got.add("lm_head.weight")
        missing = sorted(expected - got)
        if missing:
            raise CorruptModelError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:3]}; "
                                    "the weights are incomplete or truncated")
