"""A Gated DeltaNet layer's speculative verify step between its projections in three kernels (CUDA, Triton), which
GatedDeltaNet takes for verify rows where SPLIT_VERIFY is on (the default; triton_gated_delta_step.py's `step` walks
the rows otherwise).

`step` runs one program per (row, value head, tile of 8 value columns) and each walks the row's tokens: per token it
recomputes its key head's q/k convolution (every value head and tile of a key head again), waits on the token's
loads and only then runs the delta rule, so a row of 16 tokens cost ~13x what its bytes take on an H100 (54.6 us a
layer for 4.2, benchmarks/results/gpu_gdn_step_h100.json). Here the work that does not depend on the state runs
first, wide:

  inputs  one program per (row, block of channels), plus one per row for the gates: the short convolution and SiLU
          of every q/k/v channel of the row's tokens (each channel once), beta and g, written as the delta rule
          reads them and to the trail buffers (the convolution's inputs, each token's k, v, g and beta);
  rows    triton_gated_delta_rows.rows_recurrence_kernel: the delta rule over the row's tokens from the slot's state
          (all loads of a token issued before its arithmetic), the outputs, the state before the row (the pre_ssm
          trail) and the state after the row's own tokens left in the slot;
  finish  triton_gated_delta_step.finish_kernel, as in `step`'s verify path.

The arithmetic is `step`'s: the convolution and the gates through the same helpers, the delta rule as
rows_recurrence_kernel's (which `step` follows), so a verify row's own tokens still give the decode steps' bits.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from onecat.engine.kernels.triton_gated_delta_rows import rows_recurrence
from onecat.engine.kernels.triton_gated_delta_step import _conv_silu, _gates, _keep_inputs, checked_gates, finish_kernel
from onecat.engine.switches import switch

# verify rows through the three kernels here (the state-independent work first, wide) instead of `step` walking them:
# the step path's bits (interpreter and H200), 1.9-2x faster for 8 rows of 8 or 16 tokens, within 3% for one row
# (benchmarks/results/gpu_gdn_split_verify_h200_w{8,16}.json). ONECAT_GDN_SPLIT_VERIFY=0 walks them (A/B). Read once;
# tests set it.
SPLIT_VERIFY = switch("ONECAT_GDN_SPLIT_VERIFY", True)
CHANNELS = 256  # channels an inputs program convolves (8 a thread of its one warp: 128-bit loads)


@triton.jit
def inputs_kernel(proj_ptr, proj_stride, gates_ptr, gates_stride, conv_ptr, conv_w_ptr, slots_ptr, lead_ptr,
                  a_log_ptr, dt_bias_ptr, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, tconv_ptr, tk_ptr, tv_ptr, tg_ptr,
                  tbeta_ptr, W: tl.constexpr, TW: tl.constexpr, HK: tl.constexpr, HV: tl.constexpr,
                  DK: tl.constexpr, DV: tl.constexpr, TAPS: tl.constexpr, BLOCK: tl.constexpr, BH: tl.constexpr):
    """Program (row, block): block < NB convolves channels [block * BLOCK, ...) of the row's W tokens (q | k | v:
    q to q_ptr [R * W, Hk Dk], k to k_ptr and the k trail, v to v_ptr and the v trail) and keeps their inputs in the
    convolution trail; block NB computes the row's g and beta (g_ptr, beta_ptr [R * W, Hv] and their trails)."""
    KEYS: tl.constexpr = HK * DK
    VALUES: tl.constexpr = HV * DV
    CONV_DIM: tl.constexpr = 2 * KEYS + VALUES
    NB: tl.constexpr = (CONV_DIM + BLOCK - 1) // BLOCK
    pid = tl.program_id(0)
    block, row = pid % (NB + 1), pid // (NB + 1)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    lead = tl.load(lead_ptr + row).to(tl.int32)
    first = row.to(tl.int64) * W  # the row's first token
    if block < NB:
        proj = proj_ptr + first * proj_stride
        conv = conv_ptr + slot * CONV_DIM * (TAPS - 1)
        c = block * BLOCK + tl.arange(0, BLOCK)
        ok = c < CONV_DIM
        _keep_inputs(proj, conv, tconv_ptr + slot * CONV_DIM * (TAPS - 1 + TW), c, ok, lead, proj_stride, W, TW,
                     TAPS)
        is_q, is_k, is_v = ok & (c < KEYS), ok & (c >= KEYS) & (c < 2 * KEYS), ok & (c >= 2 * KEYS)
        for t in tl.static_range(W):  # unrolled: no token waits on another's loads
            x = _conv_silu(proj, conv, conv_w_ptr, c, ok, t, lead, proj_stride, BLOCK, TAPS)
            tok, at = first + t, slot * TW + t
            tl.store(q_ptr + tok * KEYS + c, x, mask=is_q)
            tl.store(k_ptr + tok * KEYS + c - KEYS, x, mask=is_k)
            tl.store(tk_ptr + at * KEYS + c - KEYS, x, mask=is_k)
            tl.store(v_ptr + tok * VALUES + c - 2 * KEYS, x, mask=is_v)
            tl.store(tv_ptr + at * VALUES + c - 2 * KEYS, x, mask=is_v)
    else:
        h = tl.arange(0, BH)
        h_ok = h < HV
        neg_a = -tl.exp(tl.load(a_log_ptr + h, mask=h_ok, other=0.0).to(tl.float32))
        dt_bias = tl.load(dt_bias_ptr + h, mask=h_ok, other=0.0).to(tl.float32)
        for t in tl.static_range(W):
            gates = gates_ptr + (first + t) * gates_stride
            g, beta = _gates(tl.load(gates + h, mask=h_ok, other=0.0), tl.load(gates + HV + h, mask=h_ok, other=0.0),
                             neg_a, dt_bias, proj_ptr.dtype.element_ty)
            tok, at = first + t, slot * TW + t
            tl.store(g_ptr + tok * HV + h, g, mask=h_ok)
            tl.store(beta_ptr + tok * HV + h, beta, mask=h_ok)
            tl.store(tg_ptr + at * HV + h, g, mask=h_ok)
            tl.store(tbeta_ptr + at * HV + h, beta, mask=h_ok)


def fused_step(proj: torch.Tensor, conv_state: torch.Tensor, conv_weight: torch.Tensor, ssm_state: torch.Tensor,
               slots: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor, norm_weight: torch.Tensor, eps: float,
               k_heads: int, v_heads: int, k_dim: int, v_dim: int, width: int = 1, lead: torch.Tensor | None = None,
               trails: tuple[torch.Tensor, ...] | None = None, gates: torch.Tensor | None = None) -> torch.Tensor:
    """triton_gated_delta_step.fused_step's verify step (its arguments; `lead` and `trails` required) in the three
    kernels above; out_proj's input [R * width, Hv Dv]."""
    if trails is None:
        raise ValueError("the split verify step runs verify rows only: it needs lead and trails")
    gates = checked_gates(proj, gates, conv_state, ssm_state, conv_weight, 2 * k_heads * k_dim + 2 * v_heads * v_dim,
                          width, lead, trails)
    tokens, taps = proj.shape[0], conv_weight.shape[1]
    rows, keys, values = tokens // width, k_heads * k_dim, v_heads * v_dim
    pre, tconv, tk, tv, tg, tbeta = trails
    trail_width = tk.shape[1]
    dev, dt = proj.device, proj.dtype
    q, k = torch.empty(tokens, keys, dtype=dt, device=dev), torch.empty(tokens, keys, dtype=dt, device=dev)
    v = torch.empty(tokens, values, dtype=dt, device=dev)
    g, beta = (torch.empty(tokens, v_heads, dtype=torch.float32, device=dev) for _ in range(2))
    shape = dict(W=width, TW=trail_width, HK=k_heads, HV=v_heads, DK=k_dim, DV=v_dim, TAPS=taps)
    blocks = triton.cdiv(2 * keys + values, CHANNELS)
    inputs_kernel[(rows * (blocks + 1),)](
        proj, proj.stride(0), gates, gates.stride(0), conv_state, conv_weight, slots, lead, a_log, dt_bias, q, k, v,
        g, beta, tconv, tk, tv, tg, tbeta, BLOCK=CHANNELS, BH=triton.next_power_of_2(v_heads), num_warps=1, **shape)
    core = torch.empty(tokens, v_heads, v_dim, dtype=torch.float32, device=dev)
    as_rows = (lambda x, heads, dim: x.view(rows, width, heads, dim))
    rows_recurrence(as_rows(q, k_heads, k_dim), as_rows(k, k_heads, k_dim), as_rows(v, v_heads, v_dim),
                    g.view(rows, width, v_heads), beta.view(rows, width, v_heads), ssm_state, slots, ssm_state, slots,
                    lead, torch.full_like(lead, width), keep_pre=pre, out=core)
    out = torch.empty(tokens, values, dtype=dt, device=dev)
    finish_kernel[(tokens * v_heads,)](core, proj, proj.stride(0), conv_state, slots, lead, norm_weight, out, eps,
                                       tconv, BD=triton.next_power_of_2(v_dim), num_warps=1,
                                       BK=triton.next_power_of_2(k_dim), TRAILS=True, **shape)
    return out
