"""A Gated DeltaNet layer's decode or verify step between its two projections, in two kernels (CUDA, Triton).

Between in_proj and out_proj the torch path runs some thirty small kernels a layer in a decode step (the gates'
casts, sigmoid and softplus, the short convolution's gather, products, sum, SiLU and scatter, the state's gather
and scatter around the recurrent kernel, the gated RMSNorm's casts and products) and some fifty in a speculative
verify step (the windows of the convolution, the trail buffers a rollback reads): on a 64-layer hybrid model
every one of them is a kernel boundary, and each costs more than the bytes it moves. Here a step is rows of W
tokens, one request each (a decode step: W = 1; a CUDA graph's verify step: the request's own tokens behind
`lead` padding tokens, engine/cache/recurrent_state.py VerifyRows):

  step   one program per (row, value head, tile of value columns) walks the row's tokens: the convolution of its
         q/k channels (its key head) and v channels over the request's inputs (the slot's carried-over K-1,
         then the row's own), SiLU, the gates (beta = sigmoid(b), g = -exp(A_log) softplus(a + dt_bias)), q/k
         l2-normalized, the delta rule on its [Dk, BV] slice of the slot's state (read and written in place in
         the cache; padding tokens leave it as it was); the outputs in float32. A verify step also writes the
         trail buffers: the state before the row, the convolution's inputs, and each token's k, v, g and beta.
  finish one program per (token, value head): the gated RMSNorm of the head's output (weight * RMSNorm(o) *
         SiLU(z)) for out_proj; a row's first token's programs also move the slot's carried-over inputs to the
         last K-1 of the request's (in a second kernel, because every value head of a key head reads the same
         q/k inputs in `step`: none may move them before all have read them).

Every value is rounded where the torch path (engine/layers/gated_deltanet.py, gated_deltanet_ops.py) rounds it
(the convolution's products and sum, SiLU, beta, the output's casts); the sums over a few values run in
another order than ATen's, so results agree with the torch path to the last bit of those roundings, not
always bit for bit. A token's arithmetic is the same in a decode and a verify step, and the delta rule's is
triton_gated_delta_rows.py's (which recomputes a rolled-back state from the trails): a verify row's own tokens
give the decode steps' bits. A row's values depend on that row alone (batch-invariant). Padded rows of a CUDA
graph step all name the cache's scratch slot: they race on it, and nothing reads it.
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
def _request_input(proj, conv, c, ok, o, lead, proj_stride, TAPS: tl.constexpr):
    """Input `o` of the request's sequence (the carried-over TAPS-1, then the row's own tokens after `lead`
    padding) of channels c: the convolution state's or the projection's (`proj`: the row's first token)."""
    carried = tl.load(conv + c * (TAPS - 1) + o, mask=ok & (o < TAPS - 1), other=0.0)
    own = tl.load(proj + (o - (TAPS - 1) + lead) * proj_stride + c, mask=ok & (o >= TAPS - 1), other=0.0)
    return tl.where(o < TAPS - 1, carried, own)


@triton.jit
def _conv_silu(proj, conv, conv_w_ptr, c, ok, t, lead, proj_stride, BLOCK: tl.constexpr, TAPS: tl.constexpr):
    """SiLU of the short convolution for row token t (own input t - lead; a padding token takes the first
    window) of channels c, in the projection's dtype: each product rounded to the weight's dtype, summed in order
    and rounded once, SiLU rounded (as causal_conv_step and GatedDeltaNet._convolve_rows)."""
    wdt = conv_w_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK], tl.float32)
    for i in tl.static_range(TAPS):
        x = _request_input(proj, conv, c, ok, tl.maximum(t - lead + i, 0), lead, proj_stride, TAPS)
        acc += _rounded(x.to(wdt).to(tl.float32) * tl.load(conv_w_ptr + c * TAPS + i, mask=ok, other=0.0), wdt)
    return _rounded(_silu(_rounded(acc, wdt)), wdt).to(proj.dtype.element_ty)


@triton.jit
def _keep_inputs(proj, conv, tconv, c, ok, lead, proj_stride, W: tl.constexpr, TW: tl.constexpr,
                 TAPS: tl.constexpr):
    """The trail of the convolution's inputs of channels c: the carried-over TAPS-1, then the row's W tokens."""
    for m in range(TAPS - 1 + W):  # a loop, not unrolled: the row's tokens
        tl.store(tconv + c * (TAPS - 1 + TW) + m, _request_input(proj, conv, c, ok, m, 0, proj_stride, TAPS), mask=ok)


@triton.jit
def _gates(b, a, neg_a, dt_bias, dt: tl.constexpr):
    """(g, beta) of a token's b and a gate inputs: beta = sigmoid(b) in the model dtype `dt`; g = -exp(A_log) *
    softplus(a + dt_bias) in float32 (neg_a = -exp(A_log), dt_bias in float32)."""
    b = b.to(dt).to(tl.float32)
    beta = _rounded(1.0 / (1.0 + tl.exp(-b)), dt)
    a = a.to(dt).to(tl.float32) + dt_bias
    e = tl.exp(tl.minimum(a, 20.0))
    u = 1.0 + e  # log1p(e) without losing a small e: log(u) * e / (u - 1)
    return neg_a * tl.where(a > 20.0, a, tl.where(u == 1.0, e, tl.log(u) * e / (u - 1.0))), beta


@triton.jit
def step_kernel(proj_ptr, proj_stride, gates_ptr, gates_stride, conv_ptr, conv_w_ptr, ssm_ptr, slots_ptr, lead_ptr,
                a_log_ptr, dt_bias_ptr, o_ptr, scale, pre_ptr, tconv_ptr, tk_ptr, tv_ptr, tg_ptr, tbeta_ptr,
                W: tl.constexpr, TW: tl.constexpr, HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr,
                DV: tl.constexpr, TAPS: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, TRAILS: tl.constexpr):
    NV: tl.constexpr = (DV + BV - 1) // BV
    KEYS: tl.constexpr = HK * DK
    VALUES: tl.constexpr = HV * DV
    CONV_DIM: tl.constexpr = 2 * KEYS + VALUES
    pid = tl.program_id(0)
    i_v, i_h, row = pid % NV, (pid // NV) % HV, pid // (NV * HV)
    i_hk = i_h // (HV // HK)
    first_of_key = (i_h % (HV // HK) == 0) & (i_v == 0)  # writes the key head's trails
    ck = tl.arange(0, BK)
    cv = i_v * BV + tl.arange(0, BV)
    k_ok, v_ok = ck < DK, cv < DV
    tile_ok = k_ok[:, None] & v_ok[None, :]
    slot = tl.load(slots_ptr + row).to(tl.int64)
    if TRAILS:
        lead = tl.load(lead_ptr + row).to(tl.int32)
    else:
        lead = tl.full([], 0, tl.int32)
    proj = proj_ptr + row.to(tl.int64) * W * proj_stride  # the row's first token
    gates = gates_ptr + row.to(tl.int64) * W * gates_stride
    conv = conv_ptr + slot * CONV_DIM * (TAPS - 1)
    c_q, c_k, c_v = i_hk * DK + ck, KEYS + i_hk * DK + ck, 2 * KEYS + i_h * DV + cv
    tile = (slot * HV + i_h) * DK * DV + ck[:, None] * DV + cv[None, :]
    h = tl.load(ssm_ptr + tile, mask=tile_ok, other=0.0)
    if TRAILS:
        tl.store(pre_ptr + tile, h, mask=tile_ok)
        tconv = tconv_ptr + slot * CONV_DIM * (TAPS - 1 + TW)
        _keep_inputs(proj, conv, tconv, c_q, k_ok & first_of_key, lead, proj_stride, W, TW, TAPS)
        _keep_inputs(proj, conv, tconv, c_k, k_ok & first_of_key, lead, proj_stride, W, TW, TAPS)
        _keep_inputs(proj, conv, tconv, c_v, v_ok, lead, proj_stride, W, TW, TAPS)
    neg_a = -tl.exp(tl.load(a_log_ptr + i_h).to(tl.float32))
    dt_bias = tl.load(dt_bias_ptr + i_h).to(tl.float32)
    for t in range(W):  # a loop, not unrolled (a verify row's 16 tokens unrolled spill on sm_70)
        q = _conv_silu(proj, conv, conv_w_ptr, c_q, k_ok, t, lead, proj_stride, BK, TAPS)
        k = _conv_silu(proj, conv, conv_w_ptr, c_k, k_ok, t, lead, proj_stride, BK, TAPS)
        v = _conv_silu(proj, conv, conv_w_ptr, c_v, v_ok, t, lead, proj_stride, BV, TAPS)
        g, beta = _gates(tl.load(gates + t * gates_stride + i_h), tl.load(gates + t * gates_stride + HV + i_h), neg_a,
                         dt_bias, proj_ptr.dtype.element_ty)
        if TRAILS:
            at = slot * TW + t
            tl.store(tk_ptr + (at * HK + i_hk) * DK + ck, k, mask=k_ok & first_of_key)
            tl.store(tv_ptr + (at * HV + i_h) * DV + cv, v, mask=v_ok)
            if i_v == 0:
                tl.store(tg_ptr + at * HV + i_h, g)
                tl.store(tbeta_ptr + at * HV + i_h, beta)
        # the delta rule on this program's [Dk, BV] slice of the state (as triton_gated_delta_rows)
        bq = q.to(tl.float32)
        bk = k.to(tl.float32)
        bq = bq / tl.sqrt(tl.sum(bq * bq) + 1e-6) * scale
        bk = bk / tl.sqrt(tl.sum(bk * bk) + 1e-6)
        stepped = h * tl.exp(g)
        delta = beta * (v.to(tl.float32) - tl.sum(stepped * bk[:, None], 0))
        stepped += bk[:, None] * delta[None, :]
        out_at = (row.to(tl.int64) * W + t) * HV + i_h
        tl.store(o_ptr + out_at * DV + cv, tl.sum(stepped * bq[:, None], 0), mask=v_ok)
        h = tl.where(t >= lead, stepped, h)
    tl.store(ssm_ptr + tile, h, mask=tile_ok)


@triton.jit
def _move_inputs(proj, conv, tconv, c, ok, lead, proj_stride, W: tl.constexpr, TW: tl.constexpr,
                 TAPS: tl.constexpr, TRAILS: tl.constexpr):
    """The slot's carried-over inputs of channels c become the last TAPS-1 of the request's (read from the
    trail in a verify step; in a decode step each moves down by one and the token's own comes last)."""
    for i in tl.static_range(TAPS - 1):
        if TRAILS:
            o = W - lead + i  # the request's inputs after its W - lead own ones; their places in the trail:
            x = tl.load(tconv + c * (TAPS - 1 + TW) + tl.where(o < TAPS - 1, o, o + lead), mask=ok)
        elif i < TAPS - 2:
            x = tl.load(conv + c * (TAPS - 1) + i + 1, mask=ok)
        else:
            x = tl.load(proj + c, mask=ok)
        tl.store(conv + c * (TAPS - 1) + i, x, mask=ok)


@triton.jit
def finish_kernel(o_ptr, proj_ptr, proj_stride, conv_ptr, slots_ptr, lead_ptr, norm_w_ptr, out_ptr, eps, tconv_ptr,
                  W: tl.constexpr, TW: tl.constexpr, HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr,
                  DV: tl.constexpr, TAPS: tl.constexpr, BK: tl.constexpr, BD: tl.constexpr, TRAILS: tl.constexpr):
    KEYS: tl.constexpr = HK * DK
    VALUES: tl.constexpr = HV * DV
    CONV_DIM: tl.constexpr = 2 * KEYS + VALUES
    pid = tl.program_id(0)
    i_h, tok = pid % HV, (pid // HV).to(tl.int64)
    dt = proj_ptr.dtype.element_ty
    cd = tl.arange(0, BD)
    d_ok = cd < DV
    # gated RMSNorm over the head (GatedRMSNorm): the output rounded to the model dtype, normed in float32 and
    # rounded, times the weight (rounded to its dtype), times SiLU(z) in float32
    o = _rounded(tl.load(o_ptr + (tok * HV + i_h) * DV + cd, mask=d_ok, other=0.0), dt)
    normed = _rounded(o * tl.rsqrt(tl.sum(o * o) / DV + eps), dt)
    weighted = _rounded(tl.load(norm_w_ptr + cd, mask=d_ok, other=0.0).to(tl.float32) * normed,
                        norm_w_ptr.dtype.element_ty)
    z = tl.load(proj_ptr + tok * proj_stride + 2 * KEYS + VALUES + i_h * DV + cd, mask=d_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + tok * VALUES + i_h * DV + cd, (weighted * _silu(z)).to(dt), mask=d_ok)
    if tok % W == 0:  # the row's first token: this head's v channels, and its key head's q and k channels
        row = tok // W
        slot = tl.load(slots_ptr + row).to(tl.int64)
        if TRAILS:
            lead = tl.load(lead_ptr + row).to(tl.int32)
        else:
            lead = tl.full([], 0, tl.int32)
        proj = proj_ptr + tok * proj_stride
        conv = conv_ptr + slot * CONV_DIM * (TAPS - 1)
        tconv = tconv_ptr + slot * CONV_DIM * (TAPS - 1 + TW)
        _move_inputs(proj, conv, tconv, 2 * KEYS + i_h * DV + cd, d_ok, lead, proj_stride, W, TW, TAPS, TRAILS)
        if i_h % (HV // HK) == 0:
            ck = tl.arange(0, BK)
            i_hk = i_h // (HV // HK)
            for part in tl.static_range(2):
                _move_inputs(proj, conv, tconv, part * KEYS + i_hk * DK + ck, ck < DK, lead, proj_stride, W, TW,
                             TAPS, TRAILS)


def step_tile(dv: int) -> int:
    """Value columns per `step` program: 8, as the verify rows' kernel (many programs in flight at batch 1)."""
    return min(8, triton.next_power_of_2(dv))


def checked_gates(proj: torch.Tensor, gates: torch.Tensor | None, conv_state: torch.Tensor, ssm_state: torch.Tensor,
                  conv_weight: torch.Tensor, values: int, width: int, lead: torch.Tensor | None,
                  trails: tuple[torch.Tensor, ...] | None) -> torch.Tensor:
    """The step's b|a gate columns (`gates`, or proj's own past its first `values` columns: 2 Hk Dk + 2 Hv Dv), after
    checking fused_step's arguments (also the split verify step's, triton_gated_delta_verify.py)."""
    tokens, keep = proj.shape[0], trails is not None
    if keep != (lead is not None) or (width > 1 and not keep):
        raise ValueError("a verify step (width > 1) needs both lead and trails; a decode step neither")
    tensors = (conv_state, ssm_state, conv_weight) + (tuple(trails) if keep else ())
    heads = ssm_state.shape[1]
    gates = proj[:, values:] if gates is None else gates
    if gates.shape != (tokens, 2 * heads) or proj.shape[1] < values:
        raise ValueError(f"the projection has {proj.shape[1]} columns and the gates {tuple(gates.shape)}: expected "
                         f"{values} (+ {2 * heads} gate columns unless the gates are apart) and ({tokens}, "
                         f"{2 * heads})")
    if proj.stride(1) != 1 or gates.stride(1) != 1 or tokens % width or not all(t.is_contiguous() for t in tensors):
        raise ValueError("the projection's columns, the state, weight and trail tensors must be contiguous, and "
                         "the projection's rows whole rows of `width` tokens")
    return gates


def fused_step(proj: torch.Tensor, conv_state: torch.Tensor, conv_weight: torch.Tensor, ssm_state: torch.Tensor,
               slots: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor, norm_weight: torch.Tensor, eps: float,
               k_heads: int, v_heads: int, k_dim: int, v_dim: int, width: int = 1, lead: torch.Tensor | None = None,
               trails: tuple[torch.Tensor, ...] | None = None, gates: torch.Tensor | None = None) -> torch.Tensor:
    """Rows of `width` tokens (row r: proj rows r * width ...; its first lead[r] tokens padding), one request each.
    proj [R * width, 2 Hk Dk + 2 Hv Dv + 2 Hv]: in_proj's output (q | k | v | z | b | a; columns contiguous), or
    [R * width, 2 Hk Dk + 2 Hv Dv] with `gates` [R * width, 2 Hv] (b | a) apart, as a projection stored in two
    parts computes them (engine/quant/row_split.py), so they need not be concatenated first;
    conv_state [S, C, K-1] and ssm_state [S, Hv, Dk, Dv] float32: this layer's cache tensors, updated in place at
    the rows' `slots` [R]; conv_weight [C, K]. A verify step (width > 1, or `trails` given) needs `lead` [R] and
    `trails`: this layer's (pre_ssm [S, Hv, Dk, Dv], conv [S, C, K-1 + TW], k [S, TW, Hk, Dk], v [S, TW, Hv, Dv],
    g [S, TW, Hv], beta [S, TW, Hv]) of a reserved width TW >= width. Returns the gated RMSNorm's output
    [R * width, Hv Dv], out_proj's input."""
    tokens, taps = proj.shape[0], conv_weight.shape[1]
    keep = trails is not None
    gates = checked_gates(proj, gates, conv_state, ssm_state, conv_weight, 2 * k_heads * k_dim + 2 * v_heads * v_dim,
                          width, lead, trails)
    trail_width = trails[2].shape[1] if keep else width
    pre, tconv, tk, tv, tg, tbeta = trails if keep else (ssm_state, conv_state, proj, proj, proj, proj)
    lead = lead if keep else slots
    core = torch.empty(tokens, v_heads, v_dim, dtype=torch.float32, device=proj.device)
    out = torch.empty(tokens, v_heads * v_dim, dtype=proj.dtype, device=proj.device)
    bk, bv = triton.next_power_of_2(k_dim), step_tile(v_dim)
    shape = dict(W=width, TW=trail_width, HK=k_heads, HV=v_heads, DK=k_dim, DV=v_dim, TAPS=taps, BK=bk, TRAILS=keep)
    step_kernel[(tokens // width * v_heads * triton.cdiv(v_dim, bv),)](
        proj, proj.stride(0), gates, gates.stride(0), conv_state, conv_weight, ssm_state, slots, lead, a_log,
        dt_bias, core, k_dim ** -0.5, pre, tconv, tk, tv, tg, tbeta, BV=bv, num_warps=1, **shape)
    finish_kernel[(tokens * v_heads,)](core, proj, proj.stride(0), conv_state, slots, lead, norm_weight, out, eps,
                                       tconv, BD=triton.next_power_of_2(v_dim), num_warps=1, **shape)
    return out
