"""Gated DeltaNet (the linear-attention layer of Qwen3.5): one input projection gives q/k/v (through a short
causal depthwise convolution), the output gate z, and per value head beta (write strength) and a (decay);
the gated delta rule mixes tokens through a per-request state; a gated RMSNorm and out_proj finish.

The state lives in the engine's RecurrentStateCache (engine/cache/recurrent_state.py); the step's StatePlan says which
rows are one-token steps (run as a batch by the recurrent form: the rows' states gathered from their slots,
updated, scattered back into the cache) and which are prefill chunks (one request at a time by the chunked
form); a step of one-token rows only (`all_decode`, which CUDA graphs replay) needs no row indexing; speculative
verify chunks run as rows of tokens (`VerifyRows`: an eager chunk one row, a CUDA graph's verify step all of
its rows, each request's own tokens behind padding), the convolution over gathered windows and the delta rule
one token after another as decode steps run it (`delta_rows`), keeping in the cache's trail buffers what a
rollback to the accepted tokens recomputes from. On CUDA the gated
delta rule runs through flash-linear-attention where it is installed (engine/kernels/fla_gated_delta.py);
elsewhere, and when `use_fla` is False, through the torch reference (gated_deltanet_ops.py). `path` says
which ran last.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from onecat.engine.cache.recurrent_state import StatePlan, VerifyRows
from onecat.engine.config import ModelConfig
from onecat.engine.errors import UnsupportedModelError
from onecat.engine.kernels import fla_gated_delta as fla
from onecat.engine.kernels.triton_support import triton_unavailable_reason
from onecat.engine.layers import gated_deltanet_ops as ops
from onecat.engine.layers import hybrid_kernels
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
    use_fused = False  # the engine turns this on per model (CUDA + Triton); the fused step needs hybrid_kernels too

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
        self.path = "none"  # "fla", "torch" or "fused step": what ran last

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
        if (plan.all_decode or plan.rows is not None) and self.use_fused and hybrid_kernels.ENABLED and x.is_cuda:
            projected, gates = self._project_apart(x)
            return self.out_proj(self.fused_step(projected, plan, gates=gates))
        projected = self.in_proj(x)
        mixed, z, b, a = projected.split(self.split_sizes, dim=-1)
        beta = pointwise(torch.sigmoid, b).float()
        g = -self.A_log.float().exp() * pointwise(F.softplus, a.float() + self.dt_bias.float())
        if plan.rows is not None:  # a CUDA graph's verify step: every token in a verify row
            return self._finish(self._verify_rows(mixed, g, beta, plan, plan.rows), z, x)
        conv_state, ssm_state = plan.conv[self.state_index], plan.ssm[self.state_index]
        convolved = self._convolve(mixed, plan, conv_state)
        q, k, v = convolved.split([self.key_size, self.key_size, self.value_size], dim=-1)
        chunk_rule, step, prepare = self._rule(x)
        q, k = q.view(T, self.k_heads, self.k_dim), k.view(T, self.k_heads, self.k_dim)
        v = v.reshape(T, self.v_heads, self.v_dim)
        if prepare:
            (q, k), v = ops.prepare_qk(q, k, self.v_heads), v.float()
        if plan.all_decode:  # one token per row: no row indexing (a CUDA graph's decode step is one of these)
            slots = plan.decode_slots
            core, ssm_state[slots] = step(q, k, v, g, beta, ssm_state[slots])
            return self._finish(core, z, x)
        core = torch.empty(T, self.v_heads, self.v_dim, dtype=torch.float32, device=x.device)
        if plan.decode_rows is not None:
            r, slots = plan.decode_rows, plan.decode_slots
            core[r], ssm_state[slots] = step(q[r], k[r], v[r], g[r], beta[r], ssm_state[slots])
        for start, end, slot, rows in plan.chunks:
            part = slice(start, end)
            if rows is None:
                core[part], ssm_state[slot] = chunk_rule(q[part], k[part], v[part], g[part], beta[part], ssm_state[slot])
            else:  # a speculative verify chunk: one verify row
                core[part] = self._verify_rows(mixed[part], g[part], beta[part], plan, rows)
        return self._finish(core, z, x)

    def _project_apart(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """in_proj's output for the fused step: where in_proj is stored in two parts, q|k|v|z packed and b|a dense
        (KEEP_DENSE_PARTS, engine/quant/row_split.py), each part's output as it comes, which the step reads where
        it lies (no concatenation kernel); otherwise the whole output and None."""
        parts = getattr(self.in_proj, "parts", None)
        if parts is not None and [p.out_features for p in parts] == [self.conv_dim + self.value_size,
                                                                     2 * self.v_heads]:
            return parts[0](x), parts[1](x)
        return self.in_proj(x), None

    def fused_step(self, projected: torch.Tensor, plan: StatePlan,
                   gates: torch.Tensor | None = None) -> torch.Tensor:
        """out_proj's input for a step of one-token rows (`plan.all_decode`) or a graph's verify rows (`plan.rows`),
        from in_proj's output (or its q|k|v|z columns and, apart, its b|a `gates`), through the two kernels of
        triton_gated_delta_step.py; the slots' convolution inputs and states (and a verify step's trails) are
        updated in the cache."""
        from onecat.engine.kernels import triton_gated_delta_step as kernel
        from onecat.engine.kernels import triton_gated_delta_verify as split

        self.path = "fused step"
        layer, rows = self.state_index, plan.rows
        verify = {}
        if rows is not None:
            t = plan.trails
            verify = dict(width=rows.width, lead=rows.lead, trails=tuple(
                buffer[layer] for buffer in (t.pre_ssm, t.conv, t.k, t.v, t.g, t.beta)))
            kernel = split if split.SPLIT_VERIFY else kernel  # verify rows in three kernels (A/B switch)
        return kernel.fused_step(projected, plan.conv[layer], self.conv1d.weight.squeeze(1), plan.ssm[layer],
                                 plan.decode_slots if rows is None else rows.slots, self.A_log, self.dt_bias,
                                 self.norm.weight, self.norm.eps, self.k_heads, self.v_heads, self.k_dim, self.v_dim,
                                 gates=gates, **verify)

    def _verify_rows(self, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, plan: StatePlan,
                     rows: VerifyRows) -> torch.Tensor:
        """The delta rule's outputs [R * W, Hv, Dv] for verify rows of W tokens (the in_proj outputs `mixed`, g
        and beta of their tokens): the convolution and the rule run over each row's own tokens from its slot's
        state, which they leave after the last of them; the state before the row and the row's inputs go to
        the trail buffers (the cache recomputes a rolled-back state from them)."""
        width = rows.width
        count = mixed.shape[0] // width
        layer, trails = self.state_index, plan.trails
        convolved = self._convolve_rows(mixed.view(count, width, -1), plan.conv[layer], rows, trails.conv[layer])
        q, k, v = convolved.split([self.key_size, self.key_size, self.value_size], dim=-1)
        q = q.reshape(count, width, self.k_heads, self.k_dim)
        k = k.reshape(count, width, self.k_heads, self.k_dim)
        v = v.reshape(count, width, self.v_heads, self.v_dim)
        g, beta = g.view(count, width, self.v_heads), beta.view(count, width, self.v_heads)
        ssm = plan.ssm[layer]
        trails.pre_ssm[layer].index_copy_(0, rows.slots, ssm.index_select(0, rows.slots))
        for kept, value in ((trails.k, k), (trails.v, v), (trails.g, g), (trails.beta, beta)):
            kept[layer][:, :width].index_copy_(0, rows.slots, value.to(kept.dtype))
        core = delta_rows(q, k, v, g, beta, ssm, rows.slots, ssm, rows.slots, rows.lead,
                          torch.full_like(rows.lead, width), reference=self.use_fla is False)
        return core.reshape(count * width, self.v_heads, self.v_dim)

    def build_verify_row_kernels(self, widths: list[int], dtype: torch.dtype, device: torch.device) -> int:
        """Build, on a row of zeros (no cache touched), the rows kernel's variants an eager verify chunk of each
        of `widths` tokens will launch (its width padded to a power of two: triton_gated_delta_rows.py), so the
        start-up warm-up pays for them and not a request's step (0.5-1 s each). Returns how many it launched."""
        if device.type != "cuda" or self.use_fla is False or triton_unavailable_reason() is not None:
            return 0
        from onecat.engine.kernels.triton_gated_delta_rows import padded_width

        padded = sorted({padded_width(w) for w in widths if w > 1})
        state = torch.zeros(1, self.v_heads, self.k_dim, self.v_dim, dtype=torch.float32, device=device)
        slot = torch.zeros(1, dtype=torch.int64, device=device)  # also each row's lead (no padding before it)
        for width in padded:
            qk = torch.zeros(1, width, self.k_heads, self.k_dim, dtype=dtype, device=device)
            v = torch.zeros(1, width, self.v_heads, self.v_dim, dtype=dtype, device=device)
            gates = torch.zeros(1, width, self.v_heads, dtype=torch.float32, device=device)
            delta_rows(qk, qk, v, gates, gates, state, slot, state, slot, slot, torch.full_like(slot, width))
        return len(padded)

    def _finish(self, core: torch.Tensor, z: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The gated RMSNorm of the rule's outputs [T, Hv, Dv] and out_proj."""
        T = x.shape[0]
        out = self.norm(core.to(x.dtype), z.reshape(T, self.v_heads, self.v_dim))
        return self.out_proj(out.reshape(T, self.value_size))

    def _convolve(self, mixed: torch.Tensor, plan: StatePlan, conv_state: torch.Tensor) -> torch.Tensor:
        """The causal convolution of the decode rows and prefill chunks, continuing each request's carried-over
        inputs (a verify chunk's rows are left for _verify_rows)."""
        weight = self.conv1d.weight.squeeze(1)
        if plan.all_decode:
            slots = plan.decode_slots
            out, conv_state[slots] = ops.causal_conv_step(mixed, conv_state[slots], weight)
            return out
        out = torch.empty_like(mixed)
        if plan.decode_rows is not None:
            r, slots = plan.decode_rows, plan.decode_slots
            out[r], conv_state[slots] = ops.causal_conv_step(mixed[r], conv_state[slots], weight)
        for start, end, slot, rows in plan.chunks:
            if rows is None:
                y, conv_state[slot] = ops.causal_conv(mixed[start:end].T, conv_state[slot], weight)
                out[start:end] = y.T
        return out

    def _convolve_rows(self, x: torch.Tensor, conv_state: torch.Tensor, rows: VerifyRows,
                       kept: torch.Tensor) -> torch.Tensor:
        """The causal convolution of verify rows x [R, W, C]: own token j of a row (at row position lead + j)
        sees the request's inputs j .. j + K-1 of (carried-over K-1, then its own), each window summed as a
        decode step sums it; padding tokens get any window. Keeps the carried-over inputs then the row's in
        `kept` [slots, C, K-1 + width] and leaves each slot's last K-1 inputs after the row's own tokens."""
        weight = self.conv1d.weight.squeeze(1)  # [C, K]
        taps = weight.shape[1]
        count, width, channels = x.shape
        full = torch.cat([conv_state.index_select(0, rows.slots).to(weight.dtype),
                          x.transpose(1, 2).to(weight.dtype)], dim=-1)  # [R, C, K-1 + W]
        kept[..., :full.shape[-1]].index_copy_(0, rows.slots, full.to(kept.dtype))
        lead = rows.lead.view(count, 1, 1)

        def placed(own: torch.Tensor) -> torch.Tensor:  # own-input index -> its place in `full` (after the padding)
            return torch.where(own < taps - 1, own, own + lead.view(count, *[1] * (own.dim() - 1)))

        at = placed((torch.arange(width, device=x.device).view(1, width, 1) - lead
                     + torch.arange(taps, device=x.device).view(1, 1, taps)).clamp_(min=0))  # [R, W, K]
        windows = full.gather(2, at.view(count, 1, width * taps).expand(count, channels, width * taps))
        out = (windows.view(count, channels, width, taps) * weight.view(channels, 1, taps)).sum(dim=-1)
        last = placed((width - lead.view(count, 1)) + torch.arange(taps - 1, device=x.device).view(1, taps - 1))
        conv_state.index_copy_(0, rows.slots, full.gather(2, last.view(count, 1, taps - 1).expand(
            count, channels, taps - 1)).to(conv_state.dtype))
        return pointwise(F.silu, out).to(x.dtype).transpose(1, 2)


def delta_rows(q, k, v, g, beta, states_in: torch.Tensor, in_index: torch.Tensor, states_out: torch.Tensor,
               out_index: torch.Tensor, begin: torch.Tensor, end: torch.Tensor, with_outputs: bool = True,
               reference: bool = False) -> torch.Tensor | None:
    """The gated delta rule over rows of tokens (gated_deltanet_ops.rows_recurrence: q, k as projected), row r
    from states_in[in_index[r]] into states_out[out_index[r]]: the Triton kernel on CUDA
    (engine/kernels/triton_gated_delta_rows.py), the torch reference elsewhere or when `reference`."""
    if states_in.is_cuda and not reference and triton_unavailable_reason() is None:
        from onecat.engine.kernels import triton_gated_delta_rows as kernel

        return kernel.rows_recurrence(q, k, v, g, beta, states_in, in_index, states_out, out_index, begin, end,
                                      with_outputs)
    out, states = ops.rows_recurrence(q, k, v, g, beta, states_in.index_select(0, in_index), begin, end)
    states_out.index_copy_(0, out_index, states)
    return out if with_outputs else None


def _reference_chunk(q, k, v, g, beta, state):
    """ops.chunk_gated_delta_rule on tokens-first tensors: q, k [n, H, Dk], v [n, H, Dv], g, beta [n, H]."""
    out, state = ops.chunk_gated_delta_rule(*(t.transpose(0, 1) for t in (q, k, v, g, beta)), state)
    return out.transpose(0, 1), state
