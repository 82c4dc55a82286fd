"""Gated DeltaNet (the linear-attention layer of Qwen3.5): one input projection gives q/k/v (through a short
causal depthwise convolution), the output gate z, and per value head beta (write strength) and a (decay);
the gated delta rule mixes tokens through a per-request state; a gated RMSNorm and out_proj finish.

The state lives in the engine's RecurrentStateCache (engine/cache/recurrent_state.py); the step's StatePlan says which
rows are one-token steps (run as a batch by the recurrent form: the rows' states gathered from their slots,
updated, scattered back into the cache) and which are prefill chunks (one request at a time by the chunked
form); a step of one-token rows only (`all_decode`, which CUDA graphs replay) needs no row indexing; a
speculative verify chunk runs token by token with the one-token ops and keeps every intermediate state in its
Trail (the cache rolls back to the accepted tokens' state). On CUDA the gated
delta rule runs through flash-linear-attention where it is installed (engine/kernels/fla_gated_delta.py);
elsewhere, and when `use_fla` is False, through the torch reference (gated_deltanet_ops.py). `path` says
which ran last.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from onecat.engine.cache.recurrent_state import StatePlan
from onecat.engine.config import ModelConfig
from onecat.engine.errors import UnsupportedModelError
from onecat.engine.kernels import fla_gated_delta as fla
from onecat.engine.layers import gated_deltanet_ops as ops
from onecat.engine.layers.linear import Linear
from onecat.engine.layers.pointwise import pointwise
from onecat.engine.layers.qwen3_5_norms import GatedRMSNorm


def linear_attention_sizes(cfg: ModelConfig) -> dict:
    """The Gated DeltaNet sizes of an HF config (linear_* keys)."""
    raw = cfg.raw
    try:
        sizes = dict(k_heads=raw["linear_num_key_heads"], v_heads=raw["linear_num_value_heads"],
                     k_dim=raw["linear_key_head_dim"], v_dim=raw["linear_value_head_dim"],
                     conv_kernel=raw.get("linear_conv_kernel_dim", 4))
    except KeyError as e:
        raise UnsupportedModelError(f"a hybrid model's config needs {e.args[0]} (Gated DeltaNet sizes)") from None
    if sizes["v_heads"] % sizes["k_heads"]:
        raise UnsupportedModelError(f"linear_num_value_heads {sizes['v_heads']} is not a multiple of "
                                    f"linear_num_key_heads {sizes['k_heads']}")
    if raw.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"hidden_act {raw['hidden_act']!r} is not supported in Gated DeltaNet; only silu")
    sizes["conv_dim"] = 2 * sizes["k_heads"] * sizes["k_dim"] + sizes["v_heads"] * sizes["v_dim"]
    return sizes


class GatedDeltaNet(nn.Module):
    """With packed weights (engine/quant/hf_packer.py) in_proj and out_proj run packed; the rows of in_proj
    named in KEEP_DENSE_PARTS stay dense when a dense checkpoint is quantized at load (a checkpoint's own
    quantized rows stay packed as stored): beta and the decay are one row per value head, and each is applied
    to every later token through the recurrent state, so a rounding there is carried on. conv1d, the norm,
    A_log and dt_bias are not linears and stay dense."""

    KEEP_DENSE_PARTS = ("in_proj_b", "in_proj_a")

    def __init__(self, cfg: ModelConfig, state_index: int):
        super().__init__()
        s = linear_attention_sizes(cfg)
        self.state_index = state_index  # this layer's place in the recurrent state cache
        self.k_heads, self.v_heads, self.k_dim, self.v_dim = s["k_heads"], s["v_heads"], s["k_dim"], s["v_dim"]
        self.key_size, self.value_size, self.conv_dim = self.k_heads * self.k_dim, self.v_heads * self.v_dim, s["conv_dim"]
        # [q | k | v (convolved) | z (output gate) | b (beta) | a (decay)]: the checkpoint's four projections
        self.split_sizes = [self.conv_dim, self.value_size, self.v_heads, self.v_heads]
        self.in_proj = Linear(cfg.hidden_size, sum(self.split_sizes), bias=False)
        starts = [sum(self.split_sizes[:i]) for i in range(4)]
        self.checkpoint_parts = {name: ("in_proj", start, size) for name, start, size in
                                 zip(("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"), starts, self.split_sizes)}
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, s["conv_kernel"], groups=self.conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.v_heads))
        self.norm = GatedRMSNorm(self.v_dim, cfg.rms_norm_eps)
        self.out_proj = Linear(self.value_size, cfg.hidden_size, bias=False)
        self.use_fla: bool | None = None  # None: where it can run; True: required; False: the torch reference
        self.path = "none"  # "fla" or "torch": what ran last

    def _rule(self, x: torch.Tensor):
        """(chunk fn, one-token step fn) of the gated delta rule for this call, and whether q/k go in as
        projected (fla normalizes them in its kernels) or prepared by ops.prepare_qk (the reference)."""
        if self.use_fla is not False:
            reason = fla.unavailable_reason(x)
            if reason is None:
                self.path = "fla"
                return fla.chunk, fla.recurrent_step, False
            if self.use_fla:
                raise RuntimeError(f"Gated DeltaNet through flash-linear-attention cannot run: {reason}")
        self.path = "torch"
        return _reference_chunk, ops.recurrent_gated_delta_step, True

    def forward(self, x: torch.Tensor, plan: StatePlan) -> torch.Tensor:
        T = x.shape[0]
        mixed, z, b, a = self.in_proj(x).split(self.split_sizes, dim=-1)
        conv_state, ssm_state = plan.conv[self.state_index], plan.ssm[self.state_index]
        mixed = self._convolve(mixed, plan, conv_state)
        q, k, v = mixed.split([self.key_size, self.key_size, self.value_size], dim=-1)
        chunk_rule, step, prepare = self._rule(x)
        q, k = q.view(T, self.k_heads, self.k_dim), k.view(T, self.k_heads, self.k_dim)
        v = v.reshape(T, self.v_heads, self.v_dim)
        if prepare:
            (q, k), v = ops.prepare_qk(q, k, self.v_heads), v.float()
        beta = pointwise(torch.sigmoid, b).float()
        g = -self.A_log.float().exp() * pointwise(F.softplus, a.float() + self.dt_bias.float())
        if plan.all_decode:  # one token per row: no row indexing (a CUDA graph step is one of these)
            slots = plan.decode_slots
            core, ssm_state[slots] = step(q, k, v, g, beta, ssm_state[slots])
            return self._finish(core, z, x)
        core = torch.empty(T, self.v_heads, self.v_dim, dtype=torch.float32, device=x.device)
        if plan.decode_rows is not None:
            r, slots = plan.decode_rows, plan.decode_slots
            core[r], ssm_state[slots] = step(q[r], k[r], v[r], g[r], beta[r], ssm_state[slots])
        for start, end, slot, trail in plan.chunks:
            if trail is None:
                part = slice(start, end)
                core[part], ssm_state[slot] = chunk_rule(q[part], k[part], v[part], g[part], beta[part], ssm_state[slot])
                continue
            s = ssm_state[slot].unsqueeze(0)
            for t in range(start, end):
                o, s = step(q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1], s)
                core[t] = o[0]
                trail.ssm[self.state_index, t - start] = s[0]
            ssm_state[slot] = s[0]
        return self._finish(core, z, x)

    def _finish(self, core: torch.Tensor, z: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The gated RMSNorm of the rule's outputs [T, Hv, Dv] and out_proj."""
        T = x.shape[0]
        out = self.norm(core.to(x.dtype), z.reshape(T, self.v_heads, self.v_dim))
        return self.out_proj(out.reshape(T, self.value_size))

    def _convolve(self, mixed: torch.Tensor, plan: StatePlan, conv_state: torch.Tensor) -> torch.Tensor:
        """The causal convolution of every row, continuing each request's carried-over inputs."""
        weight = self.conv1d.weight.squeeze(1)
        if plan.all_decode:
            slots = plan.decode_slots
            out, conv_state[slots] = ops.causal_conv_step(mixed, conv_state[slots], weight)
            return out
        out = torch.empty_like(mixed)
        if plan.decode_rows is not None:
            r, slots = plan.decode_rows, plan.decode_slots
            out[r], conv_state[slots] = ops.causal_conv_step(mixed[r], conv_state[slots], weight)
        for start, end, slot, trail in plan.chunks:
            if trail is None:
                y, conv_state[slot] = ops.causal_conv(mixed[start:end].T, conv_state[slot], weight)
                out[start:end] = y.T
                continue
            trail.conv[self.state_index] = torch.cat([conv_state[slot], mixed[start:end].T.to(conv_state.dtype)], -1)
            state = conv_state[slot].unsqueeze(0)
            for t in range(start, end):
                y, state = ops.causal_conv_step(mixed[t:t + 1], state, weight)
                out[t] = y[0]
            conv_state[slot] = state[0]
        return out


def _reference_chunk(q, k, v, g, beta, state):
    """ops.chunk_gated_delta_rule on tokens-first tensors: q, k [n, H, Dk], v [n, H, Dv], g, beta [n, H]."""
    out, state = ops.chunk_gated_delta_rule(*(t.transpose(0, 1) for t in (q, k, v, g, beta)), state)
    return out.transpose(0, 1), state
