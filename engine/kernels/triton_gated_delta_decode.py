"""A Gated DeltaNet layer's one-token decode step between its two projections, in two kernels (CUDA, Triton).

Between in_proj and out_proj the torch path runs some thirty small kernels a layer (the gates' casts,
sigmoid and softplus, the short convolution's gather, products, sum, SiLU and scatter, the state's gather
and scatter around the recurrent kernel, the gated RMSNorm's casts and products): on a 64-layer hybrid
model at batch 1 every one of them is a kernel boundary, and each costs more than the bytes it moves.
Here:

  step   one program per (row, value head, tile of value columns): the convolution of its q/k channels
         (its key head) and v channels from the slot's carried-over inputs, SiLU, the gates (beta =
         sigmoid(b), g = -exp(A_log) softplus(a + dt_bias)), q/k l2-normalized, and the delta rule on its
         [Dk, BV] slice of the slot's state, read and written in place in the cache; the output in float32.
  finish one program per (row, value head): the gated RMSNorm of the head's output (weight * RMSNorm(o) *
         SiLU(z)) for out_proj, and the shift of the convolution's carried-over inputs of the head's
         channels (a second kernel, because every value head of a key head reads the same q/k inputs in
         `step`: none may move them before all have read them).

Every value is rounded where the torch path (engine/layers/gated_deltanet.py, gated_deltanet_ops.py) rounds it
(the convolution's products and sum, SiLU, beta, the output's casts); the sums over a few values run in
another order than ATen's, so results agree with the torch path to the last bit of those roundings, not bit
for bit. A row's values depend on that row alone (batch-invariant). Padded rows of a CUDA graph step all
name the cache's scratch slot: they race on it, and nothing reads it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rounded(x, dtype: tl.constexpr):
    """x (float32) rounded to `dtype` and back: where the torch path stores an intermediate in that dtype."""
    return x.to(dtype).to(tl.float32)


@triton.jit
def _silu(x):
    return x / (1.0 + tl.exp(-x))


@triton.jit
def decode_step_kernel(proj_ptr, proj_stride, conv_ptr, conv_w_ptr, ssm_ptr, slots_ptr, a_log_ptr, dt_bias_ptr,
                       o_ptr, scale, HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                       TAPS: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    NV: tl.constexpr = (DV + BV - 1) // BV
    KEYS: tl.constexpr = HK * DK
    VALUES: tl.constexpr = HV * DV
    CONV_DIM: tl.constexpr = 2 * KEYS + VALUES
    pid = tl.program_id(0)
    i_v, i_h, row = pid % NV, (pid // NV) % HV, pid // (NV * HV)
    i_hk = i_h // (HV // HK)
    ck = tl.arange(0, BK)
    cv = i_v * BV + tl.arange(0, BV)
    k_ok, v_ok = ck < DK, cv < DV
    slot = tl.load(slots_ptr + row).to(tl.int64)
    proj = proj_ptr + row.to(tl.int64) * proj_stride
    dt = proj_ptr.dtype.element_ty
    # the short causal convolution: carried-over inputs j = 0 .. TAPS-2, then this token's; each product
    # rounded to the weight's dtype, summed in order and rounded once, SiLU rounded (as causal_conv_step)
    wdt = conv_w_ptr.dtype.element_ty
    c_q = i_hk * DK + ck
    c_k = KEYS + i_hk * DK + ck
    c_v = 2 * KEYS + i_h * DV + cv
    conv = conv_ptr + slot * CONV_DIM * (TAPS - 1)
    sq = tl.zeros([BK], tl.float32)
    sk = tl.zeros([BK], tl.float32)
    sv = tl.zeros([BV], tl.float32)
    for j in tl.static_range(TAPS):
        if j < TAPS - 1:
            xq = tl.load(conv + c_q * (TAPS - 1) + j, mask=k_ok, other=0.0)
            xk = tl.load(conv + c_k * (TAPS - 1) + j, mask=k_ok, other=0.0)
            xv = tl.load(conv + c_v * (TAPS - 1) + j, mask=v_ok, other=0.0)
        else:
            xq = tl.load(proj + c_q, mask=k_ok, other=0.0)
            xk = tl.load(proj + c_k, mask=k_ok, other=0.0)
            xv = tl.load(proj + c_v, mask=v_ok, other=0.0)
        sq += _rounded(xq.to(wdt).to(tl.float32) * tl.load(conv_w_ptr + c_q * TAPS + j, mask=k_ok, other=0.0), wdt)
        sk += _rounded(xk.to(wdt).to(tl.float32) * tl.load(conv_w_ptr + c_k * TAPS + j, mask=k_ok, other=0.0), wdt)
        sv += _rounded(xv.to(wdt).to(tl.float32) * tl.load(conv_w_ptr + c_v * TAPS + j, mask=v_ok, other=0.0), wdt)
    bq = _rounded(_silu(_rounded(sq, wdt)), wdt).to(dt).to(tl.float32)
    bk = _rounded(_silu(_rounded(sk, wdt)), wdt).to(dt).to(tl.float32)
    bv = _rounded(_silu(_rounded(sv, wdt)), wdt).to(dt).to(tl.float32)
    # the gates: beta = sigmoid(b) in the model dtype; g = -exp(A_log) * softplus(a + dt_bias) in float32
    b = tl.load(proj + 2 * KEYS + 2 * VALUES + i_h).to(tl.float32)
    beta = (1.0 / (1.0 + tl.exp(-b))).to(dt).to(tl.float32)
    a = tl.load(proj + 2 * KEYS + 2 * VALUES + HV + i_h).to(tl.float32) + tl.load(dt_bias_ptr + i_h).to(tl.float32)
    e = tl.exp(tl.minimum(a, 20.0))
    u = 1.0 + e  # log1p(e) without losing a small e: log(u) * e / (u - 1)
    softplus = tl.where(a > 20.0, a, tl.where(u == 1.0, e, tl.log(u) * e / (u - 1.0)))
    g = -tl.exp(tl.load(a_log_ptr + i_h).to(tl.float32)) * softplus
    # the delta rule on this program's [Dk, BV] slice of the state (as triton_gated_delta_rows)
    bq = bq / tl.sqrt(tl.sum(bq * bq) + 1e-6) * scale
    bk = bk / tl.sqrt(tl.sum(bk * bk) + 1e-6)
    state = ssm_ptr + (slot * HV + i_h) * DK * DV + ck[:, None] * DV + cv[None, :]
    tile_ok = k_ok[:, None] & v_ok[None, :]
    h = tl.load(state, mask=tile_ok, other=0.0) * tl.exp(g)
    delta = beta * (bv - tl.sum(h * bk[:, None], 0))
    h += bk[:, None] * delta[None, :]
    tl.store(o_ptr + (row.to(tl.int64) * HV + i_h) * DV + cv, tl.sum(h * bq[:, None], 0), mask=v_ok)
    tl.store(state, h, mask=tile_ok)


@triton.jit
def decode_finish_kernel(o_ptr, proj_ptr, proj_stride, conv_ptr, slots_ptr, norm_w_ptr, out_ptr, eps,
                         HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                         TAPS: tl.constexpr, BK: tl.constexpr, BD: tl.constexpr):
    KEYS: tl.constexpr = HK * DK
    VALUES: tl.constexpr = HV * DV
    CONV_DIM: tl.constexpr = 2 * KEYS + VALUES
    pid = tl.program_id(0)
    i_h, row = pid % HV, pid // HV
    row64 = row.to(tl.int64)
    proj = proj_ptr + row64 * proj_stride
    dt = proj_ptr.dtype.element_ty
    cd = tl.arange(0, BD)
    d_ok = cd < DV
    # gated RMSNorm over the head (GatedRMSNorm): the output rounded to the model dtype, normed in float32 and
    # rounded, times the weight in the model dtype, times SiLU(z) in float32
    o = tl.load(o_ptr + (row64 * HV + i_h) * DV + cd, mask=d_ok, other=0.0).to(dt).to(tl.float32)
    normed = (o * tl.rsqrt(tl.sum(o * o) / DV + eps)).to(dt).to(tl.float32)
    weighted = _rounded(tl.load(norm_w_ptr + cd, mask=d_ok, other=0.0).to(tl.float32) * normed,
                        norm_w_ptr.dtype.element_ty)
    z = tl.load(proj + 2 * KEYS + VALUES + i_h * DV + cd, mask=d_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row64 * VALUES + i_h * DV + cd, (weighted * _silu(z)).to(dt), mask=d_ok)
    # the convolution's carried-over inputs move by one: this head's v channels, and its key head's q and k
    # channels from the first value head of that key head
    slot = tl.load(slots_ptr + row).to(tl.int64)
    conv = conv_ptr + slot * CONV_DIM * (TAPS - 1)
    c_v = 2 * KEYS + i_h * DV + cd
    for j in tl.static_range(TAPS - 2):
        tl.store(conv + c_v * (TAPS - 1) + j, tl.load(conv + c_v * (TAPS - 1) + j + 1, mask=d_ok), mask=d_ok)
    tl.store(conv + c_v * (TAPS - 1) + TAPS - 2, tl.load(proj + c_v, mask=d_ok), mask=d_ok)
    if i_h % (HV // HK) == 0:
        ck = tl.arange(0, BK)
        k_ok = ck < DK
        i_hk = i_h // (HV // HK)
        for part in tl.static_range(2):
            c = part * KEYS + i_hk * DK + ck
            for j in tl.static_range(TAPS - 2):
                tl.store(conv + c * (TAPS - 1) + j, tl.load(conv + c * (TAPS - 1) + j + 1, mask=k_ok), mask=k_ok)
            tl.store(conv + c * (TAPS - 1) + TAPS - 2, tl.load(proj + c, mask=k_ok), mask=k_ok)


def step_tile(dv: int) -> int:
    """Value columns per `step` program: 8, as the verify rows' kernel (many programs in flight at batch 1)."""
    return min(8, triton.next_power_of_2(dv))


def decode(proj: torch.Tensor, conv_state: torch.Tensor, conv_weight: torch.Tensor, ssm_state: torch.Tensor,
           slots: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor, norm_weight: torch.Tensor, eps: float,
           k_heads: int, v_heads: int, k_dim: int, v_dim: int) -> torch.Tensor:
    """One decode token per row. proj [B, 2 Hk Dk + 2 Hv Dv + 2 Hv]: in_proj's output (q | k | v | z | b | a;
    rows may be strided, columns contiguous); conv_state [S, C, K-1] and ssm_state [S, Hv, Dk, Dv] float32:
    this layer's cache tensors (contiguous), updated in place at rows' `slots` [B]; conv_weight [C, K].
    Returns the gated RMSNorm's output [B, Hv Dv], out_proj's input."""
    rows, taps = proj.shape[0], conv_weight.shape[1]
    if proj.stride(1) != 1 or not (conv_state.is_contiguous() and ssm_state.is_contiguous()
                                   and conv_weight.is_contiguous()):
        raise ValueError("the projection's columns and the state and weight tensors must be contiguous")
    core = torch.empty(rows, v_heads, v_dim, dtype=torch.float32, device=proj.device)
    out = torch.empty(rows, v_heads * v_dim, dtype=proj.dtype, device=proj.device)
    bk, bv = triton.next_power_of_2(k_dim), step_tile(v_dim)
    shape = dict(HK=k_heads, HV=v_heads, DK=k_dim, DV=v_dim, TAPS=taps, BK=bk)
    decode_step_kernel[(rows * v_heads * triton.cdiv(v_dim, bv),)](
        proj, proj.stride(0), conv_state, conv_weight, ssm_state, slots, a_log, dt_bias, core, k_dim ** -0.5,
        BV=bv, num_warps=1, **shape)
    decode_finish_kernel[(rows * v_heads,)](core, proj, proj.stride(0), conv_state, slots, norm_weight, out, eps,
                                            BD=triton.next_power_of_2(v_dim), num_warps=1, **shape)
    return out
