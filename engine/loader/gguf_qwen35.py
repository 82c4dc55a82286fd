"""Qwen3.5 and Qwen3.5-MoE GGUF files (`qwen35`, `qwen35moe`) back into the HF config and HF weights.

llama.cpp's converter changes a Qwen3.5 checkpoint on the way in, and each change is undone here:

- zero-centered RMSNorm weights (every norm but Gated DeltaNet's gated norm) are stored as 1 + w;
- A_log is stored as A = -exp(A_log) (`ssm_a`), dt_bias as `ssm_dt.bias`, the conv1d kernel squeezed to
  [channels, kernel];
- where a key head serves several value heads, the value heads are stored in tiled order (for ggml's
  broadcast) instead of grouped by key head: the V rows of in_proj_qkv and the conv channels, in_proj_z's
  rows, in_proj_a/in_proj_b's rows, A_log and dt_bias, and out_proj's columns;
- optionally (--fuse-qkv, --fuse-gate-up-exps) a full-attention layer's q/k/v in one `attn_qkv` and the
  experts' gate and up projections in one `ffn_gate_up_exps`;
- a multi-token-prediction head, when kept, is extra blocks after the decoder layers (`nextn_predict_layers`);
  it is not read.

The gated attention's q_proj (query and gate per head) and the experts (stacked per projection, as in
`qwen3moe`) are stored as in the HF checkpoint. The sizes come from the `ssm.*` keys as llama.cpp reads them:
state_size is the key head size, group_count the key heads, time_step_rank the value heads, inner_size the
value heads times the value head size.
"""
from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch

from onecat.engine.errors import CorruptModelError, UnsupportedModelError

QWEN35_ARCHS = {"qwen35": "Qwen3_5ForCausalLM", "qwen35moe": "Qwen3_5MoeForCausalLM"}
_SOFTMAX_GATING = 1  # gguf ExpertGatingFuncType.SOFTMAX

# GGUF tensor (after `blk.N.`) -> HF name (after `model.layers.N.`) and the reverse transform's kind
_PLAIN = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "ffn_gate_inp": "mlp.gate", "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj", "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj", "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj", "ssm_norm": "linear_attn.norm",
}
_NORMS = {"attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
          "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}


def qwen35_config(reader, arch: str, path: Path, field_value, tensor_names: set[str]) -> dict:
    """The HF `Qwen3_5(Moe)TextConfig` keys of a qwen35 / qwen35moe GGUF file."""

    def g(key, default=None):
        return field_value(reader, f"{arch}.{key}", default)

    def need(key):
        v = g(key)
        if v is None:
            raise UnsupportedModelError(f"GGUF {arch} file {path} lacks the metadata key {arch}.{key}")
        return v

    blocks, nextn = int(need("block_count")), int(g("nextn_predict_layers", 0) or 0)
    n = blocks - nextn
    if "blk.0.attn_norm.weight" not in tensor_names:
        raise UnsupportedModelError(f"{path} holds only a multi-token-prediction head (a draft exported with "
                                    "--mtp), not the model's decoder layers")
    recurrent = g("attention.recurrent_layers")
    if recurrent is None:  # older files: every full_attention_interval-th layer is full attention
        every = int(g("full_attention_interval", 4))
        recurrent = [(i + 1) % every != 0 for i in range(n)]
    if len(recurrent) < n:
        raise CorruptModelError(f"{path}: {arch}.attention.recurrent_layers has {len(recurrent)} entries for {n} layers")
    heads, head_dim = int(need("attention.head_count")), int(need("attention.key_length"))
    if int(g("attention.value_length", head_dim)) != head_dim:
        raise UnsupportedModelError(f"{path}: attention value_length != key_length is not a Qwen3.5 layout")
    v_heads, inner = int(need("ssm.time_step_rank")), int(need("ssm.inner_size"))
    rope_dims = int(g("rope.dimension_count", head_dim // 4))
    kv_heads = g("attention.head_count_kv", heads)
    if isinstance(kv_heads, list):  # per layer (0 on the linear-attention ones): the full-attention layers' count
        kv_heads = [h for h, r in zip(kv_heads, recurrent) if not r] or [heads]
    cfg = {
        "num_hidden_layers": n,
        "num_key_value_heads": _uniform(kv_heads, "attention.head_count_kv", n, path),
        "layer_types": ["linear_attention" if bool(r) else "full_attention" for r in recurrent[:n]],
        "head_dim": head_dim,
        "linear_conv_kernel_dim": int(need("ssm.conv_kernel")),
        "linear_key_head_dim": int(need("ssm.state_size")),
        "linear_num_key_heads": int(need("ssm.group_count")),
        "linear_num_value_heads": v_heads,
        "linear_value_head_dim": inner // v_heads,
        # text-only positions: the interleaved MRoPE sections all rotate by the same position, which is plain
        # RoPE over the rotary part of the head
        "rope_parameters": {"rope_type": "default", "rope_theta": float(g("rope.freq_base", 10000.0)),
                            "partial_rotary_factor": rope_dims / head_dim},
        "hidden_act": "silu",
    }
    if arch == "qwen35":
        cfg["intermediate_size"] = _uniform(need("feed_forward_length"), "feed_forward_length", n, path)
        return cfg
    scale = g("expert_weights_scale")
    if scale is not None and float(scale) != 1.0:
        raise UnsupportedModelError(f"{path}: {arch}.expert_weights_scale={scale} (scaled routing weights) is not "
                                    "supported; Qwen3.5-MoE routes with renormalized top-k softmax weights")
    gating = g("expert_gating_func")
    if gating is not None and int(gating) != _SOFTMAX_GATING:
        raise UnsupportedModelError(f"{path}: {arch}.expert_gating_func={gating} is not supported; only softmax")
    shared = g("expert_shared_feed_forward_length")
    if shared is None and "blk.0.ffn_gate_shexp.weight" in tensor_names:
        shared = int(g("feed_forward_length", 0) or 0)  # llama.cpp's fallback
    cfg.update(intermediate_size=0, num_experts=int(need("expert_count")),
               num_experts_per_tok=int(need("expert_used_count")),
               moe_intermediate_size=_uniform(need("expert_feed_forward_length"), "expert_feed_forward_length", n, path),
               shared_expert_intermediate_size=int(shared or 0), norm_topk_prob=True)
    return cfg


def _uniform(value, key: str, n: int, path: Path) -> int:
    """A size key that may be a per-layer array: onecat's models need one size for every layer."""
    if isinstance(value, list):
        if len(set(value[:n])) != 1:
            raise UnsupportedModelError(f"{path}: per-layer {key} {value[:n]} is not supported (one size for all layers)")
        value = value[0]
    return int(value or 0)


def _tiled_to_grouped(x: torch.Tensor, dim: int, k_heads: int, head_size: int) -> torch.Tensor:
    """Undo the converter's value-head reorder along `dim` (of v_heads * head_size entries): stored as
    [v per k, k heads, head_size], the model's order is [k heads, v per k, head_size]."""
    shape = list(x.shape)
    per_k = shape[dim] // (k_heads * head_size)
    x = x.reshape(*shape[:dim], per_k, k_heads, head_size, *shape[dim + 1:])
    return x.transpose(dim, dim + 1).reshape(shape)


def _a_log(a: torch.Tensor) -> torch.Tensor:
    """A_log from A = -exp(A_log): the float32 value whose exp (as the model takes it) gives back -A exactly,
    where one lies within two ulps of log(-A)."""
    target = -a
    if bool((target <= 0).any()):
        raise CorruptModelError("ssm_a holds a non-negative decay rate A; the file is corrupt")
    best = torch.log(target.double()).float()
    found = torch.exp(best) == target
    for direction in (torch.inf, -torch.inf):
        cand = best
        for _ in range(2):
            cand = torch.nextafter(cand, torch.full_like(cand, direction))
            hit = (torch.exp(cand) == target) & ~found
            best, found = torch.where(hit, cand, best), found | hit
    return best


def iter_qwen35_weights(reader, cfg: dict, dequantize: Callable) -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named, HF-layout weights of a qwen35 / qwen35moe file (dequantized; see the module docstring)."""
    n = cfg["num_hidden_layers"]
    k_heads, k_dim = cfg["linear_num_key_heads"], cfg["linear_key_head_dim"]
    v_dim = cfg["linear_value_head_dim"]
    q2, kv = 2 * cfg["num_attention_heads"] * cfg["head_dim"], cfg["num_key_value_heads"] * cfg["head_dim"]
    linear = {i for i, t in enumerate(cfg["layer_types"]) if t == "linear_attention"}
    top = {"token_embd.weight": "model.embed_tokens.weight", "output.weight": "lm_head.weight"}
    for t in reader.tensors:
        if t.name == "output_norm.weight":
            yield "model.norm.weight", _tensor(dequantize(t)) - 1.0
            continue
        if t.name in top:
            yield top[t.name], _tensor(dequantize(t))
            continue
        m = re.fullmatch(r"blk\.(\d+)\.([\w.]+)", t.name)
        if m is None:
            raise UnsupportedModelError(f"unexpected GGUF tensor {t.name} for architecture {cfg['model_type']}")
        i, part = int(m.group(1)), m.group(2)
        if i >= n or part.startswith("nextn."):
            continue  # the multi-token-prediction head
        pre, w = f"model.layers.{i}.", _tensor(dequantize(t))
        base, _, kind = part.rpartition(".")
        base, kind = (base, kind) if kind in ("weight", "bias") else (part, "")
        if base in _NORMS and kind == "weight":
            yield pre + _NORMS[base] + ".weight", w - 1.0
        elif base == "attn_qkv" and i in linear and kind == "weight":
            qk = 2 * k_heads * k_dim
            yield pre + "linear_attn.in_proj_qkv.weight", torch.cat(
                [w[:qk], _tiled_to_grouped(w[qk:], 0, k_heads, v_dim)])
        elif base == "attn_qkv":  # --fuse-qkv on a full-attention layer
            for name, start, rows in (("q_proj", 0, q2), ("k_proj", q2, kv), ("v_proj", q2 + kv, kv)):
                yield f"{pre}self_attn.{name}.{kind}", w[start:start + rows]
        elif base == "attn_gate" and kind == "weight":
            yield pre + "linear_attn.in_proj_z.weight", _tiled_to_grouped(w, 0, k_heads, v_dim)
        elif base in ("ssm_alpha", "ssm_beta") and kind == "weight":
            yield f"{pre}linear_attn.in_proj_{base[4]}.weight", _tiled_to_grouped(w, 0, k_heads, 1)
        elif base == "ssm_a" and kind == "":
            yield pre + "linear_attn.A_log", _a_log(_tiled_to_grouped(w, 0, k_heads, 1))
        elif base == "ssm_dt" and kind == "bias":
            yield pre + "linear_attn.dt_bias", _tiled_to_grouped(w, 0, k_heads, 1)
        elif base == "ssm_conv1d" and kind == "weight":
            qk = 2 * k_heads * k_dim
            w = torch.cat([w[:qk], _tiled_to_grouped(w[qk:], 0, k_heads, v_dim)])
            yield pre + "linear_attn.conv1d.weight", w.unsqueeze(1)
        elif base == "ssm_out" and kind == "weight":
            yield pre + "linear_attn.out_proj.weight", _tiled_to_grouped(w, 1, k_heads, v_dim)
        elif base == "ffn_gate_up_exps" and kind == "weight":  # --fuse-gate-up-exps: [E, 2I, H]
            half = w.shape[1] // 2
            yield pre + "mlp.experts.gate_proj.weight", w[:, :half]
            yield pre + "mlp.experts.up_proj.weight", w[:, half:]
        elif base == "ffn_gate_inp_shexp" and kind == "weight":  # [H] or [1, H]
            yield pre + "mlp.shared_expert_gate.weight", w.reshape(1, -1)
        elif base in _PLAIN and kind:
            yield f"{pre}{_PLAIN[base]}.{kind}", w
        else:
            raise UnsupportedModelError(f"unexpected GGUF tensor {t.name} for architecture {cfg['model_type']}")


def _tensor(arr: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.array(arr, copy=True))
