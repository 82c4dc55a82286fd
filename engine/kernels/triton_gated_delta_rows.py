"""The gated delta rule over rows of tokens in one kernel (CUDA, Triton): a speculative verify step's rows,
each one request's token and drafts behind padding, and the recomputation of a rolled-back request's state.

One program per (row, value head, tile of value columns) keeps its [Dk, BV] slice of the state in registers
and walks the row's W tokens in order; token t changes the state only where begin[row] <= t < end[row], so
padding around a row's own tokens leaves it as it was. q and k come as projected: each is l2-normalized here
(eps 1e-6) and q scaled by Dk^-1/2, value head h reading key head h // (Hv / Hk), as the reference
(engine/layers/gated_deltanet_ops.py rows_recurrence) and flash-linear-attention's recurrent form do. The
states are read from `states_in[in_index[row]]` and the result written to `states_out[out_index[row]]` (the
cache's own tensors: no gather or scatter copies), the outputs only where asked.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from onecat.engine.kernels.triton_builds import aligned


@triton.jit
def rows_recurrence_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, s_in_ptr, in_idx_ptr, s_out_ptr, out_idx_ptr,
                           begin_ptr, end_ptr, o_ptr, pre_ptr, scale, W: tl.constexpr, HK: tl.constexpr,
                           HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                           WRITE_O: tl.constexpr, KEEP_PRE: tl.constexpr = False):
    NV: tl.constexpr = (DV + BV - 1) // BV
    pid = tl.program_id(0)
    i_v, i_h, row = pid % NV, (pid // NV) % HV, pid // (NV * HV)
    i_hk = i_h // (HV // HK)
    ck = tl.arange(0, BK)
    cv = i_v * BV + tl.arange(0, BV)
    k_ok, v_ok = ck < DK, cv < DV
    tile_ok = k_ok[:, None] & v_ok[None, :]
    first = tl.load(begin_ptr + row)
    stop = tl.load(end_ptr + row)
    src = tl.load(in_idx_ptr + row).to(tl.int64)
    h = tl.load(s_in_ptr + (src * HV + i_h) * DK * DV + ck[:, None] * DV + cv[None, :], mask=tile_ok, other=0.0)
    if KEEP_PRE:  # the state before the row, for a rollback (a verify step's trail)
        tl.store(pre_ptr + (src * HV + i_h) * DK * DV + ck[:, None] * DV + cv[None, :], h, mask=tile_ok)
    for t in tl.static_range(W):
        tok = row.to(tl.int64) * W + t
        bq = tl.load(q_ptr + (tok * HK + i_hk) * DK + ck, mask=k_ok, other=0.0).to(tl.float32)
        bk = tl.load(k_ptr + (tok * HK + i_hk) * DK + ck, mask=k_ok, other=0.0).to(tl.float32)
        bv = tl.load(v_ptr + (tok * HV + i_h) * DV + cv, mask=v_ok, other=0.0).to(tl.float32)
        bg = tl.load(g_ptr + tok * HV + i_h)
        bb = tl.load(beta_ptr + tok * HV + i_h)
        bq = bq / tl.sqrt(tl.sum(bq * bq) + 1e-6) * scale
        bk = bk / tl.sqrt(tl.sum(bk * bk) + 1e-6)
        stepped = h * tl.exp(bg)
        delta = bb * (bv - tl.sum(stepped * bk[:, None], 0))
        stepped += bk[:, None] * delta[None, :]
        if WRITE_O:
            tl.store(o_ptr + (tok * HV + i_h) * DV + cv, tl.sum(stepped * bq[:, None], 0), mask=v_ok)
        live = (t >= first) & (t < stop)
        h = tl.where(live, stepped, h)
    dst = tl.load(out_idx_ptr + row).to(tl.int64)
    tl.store(s_out_ptr + (dst * HV + i_h) * DK * DV + ck[:, None] * DV + cv[None, :], h, mask=tile_ok)


def rows_recurrence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    states_in: torch.Tensor, in_index: torch.Tensor, states_out: torch.Tensor,
                    out_index: torch.Tensor, begin: torch.Tensor, end: torch.Tensor,
                    with_outputs: bool = True, keep_pre: torch.Tensor | None = None,
                    out: torch.Tensor | None = None) -> torch.Tensor | None:
    """q, k [R, W, Hk, Dk]; v [R, W, Hv, Dv]; g, beta [R, W, Hv] float32; states_in / states_out [S, Hv, Dk, Dv]
    float32 (contiguous; may be the same tensor), row r reading states_in[in_index[r]] and writing its state
    after its own tokens to states_out[out_index[r]]; begin, end [R]. Returns the outputs [R, W, Hv, Dv] float32
    (None when not `with_outputs`; written into `out` where given). `keep_pre` [S, Hv, Dk, Dv]: row r's state
    before its tokens is also written to keep_pre[in_index[r]]. Without `out`, rows are padded to a power-of-two
    width (end[r] <= W always: the padding never changes a state): an eager verify chunk's width is its own draft
    count + 1, and each width of the unrolled kernel is a build of its own (0.5-1 s on a step, triton_builds.py)."""
    rows, width, hk, dk = k.shape
    hv, dv = v.shape[-2:]
    padded = width if out is not None else padded_width(width)
    if padded > width:  # W is the kernel's unrolled length: a few builds, not one per draft count
        q, k, v, g, beta = (_pad_tokens(t, padded) for t in (q, k, v, g, beta))
    else:
        q, k, v, g, beta = (aligned(t.contiguous()) for t in (q, k, v, g, beta))
    g, beta = aligned(g.float()), aligned(beta.float())
    in_index, out_index, begin, end = (aligned(t) for t in (in_index, out_index, begin, end))
    if with_outputs and out is None:
        out = torch.empty(rows, padded, hv, dv, dtype=torch.float32, device=v.device)
    bv = min(8, triton.next_power_of_2(dv))
    grid = (rows * hv * triton.cdiv(dv, bv),)
    rows_recurrence_kernel[grid](q, k, v, g, beta, states_in, in_index, states_out, out_index,
                                 begin, end, out if with_outputs else v, states_in if keep_pre is None else keep_pre,
                                 dk ** -0.5, W=padded, HK=hk, HV=hv, DK=dk, DV=dv, BK=triton.next_power_of_2(dk), BV=bv,
                                 WRITE_O=with_outputs, KEEP_PRE=keep_pre is not None, num_warps=1)
    return out[:, :width] if out is not None and padded > width else out


def padded_width(width: int) -> int:
    """The width a row of `width` tokens runs at without a caller's buffer: W is the kernel's unrolled length, so
    a power of two keeps the builds to a few (the warm-up builds each one an eager verify chunk can take)."""
    return triton.next_power_of_2(width)


def _pad_tokens(t: torch.Tensor, width: int) -> torch.Tensor:
    """t [R, W, ...] as [R, width, ...] (width > W), zeros after the row's tokens: past every row's end, they leave
    its state as it was."""
    out = t.new_zeros(t.shape[0], width, *t.shape[2:])
    out[:, :t.shape[1]] = t
    return out
