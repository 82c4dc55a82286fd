"""Fused CUDA kernels (Triton) for the small per-layer ops of a decode step.

At batch 1 a decoder layer is 4 weight GEMMs and attention; the rest (residual adds, RMSNorm, RoPE,
q/k norm, the KV-cache write, SiLU*mul) is ~35 tiny kernels whose launch and latency cost more than
their bytes. Three kernels replace them:
  add_rmsnorm      residual add + RMSNorm (fp32 statistics, cast, weight multiply as the reference; or
                   Qwen3.5's zero-centered form, (1 + weight) multiplied before the cast)
  silu_mul         SiLU(gate) * up from the fused gate/up output
  qk_rope_cache    optional per-head q/k RMSNorm, NeoX RoPE on q and k (in place), K/V store into the
                   paged cache at the step's slots
and, for greedy decoding, a row-wise argmax over the vocabulary in two parallel passes (the library
reduction reads a 128K-entry row with too few threads: ~30 us on an H200).
The torch layers of engine/layers/ are the reference numerics; these kernels follow the same order
of operations (fp32 statistics, one cast before the weight multiply) but round intermediate values
differently, so results agree to fp16 rounding, not bit for bit. Each kernel works on one token row
at a time, so a row's result never depends on the batch it is in. Whether they can run here:
triton_support.fused_unavailable_reason.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from onecat.engine.kernels import pdl
from onecat.engine.kernels.triton_builds import aligned


@triton.jit
def add_rmsnorm_kernel(x_ptr, r_ptr, w_ptr, out_ptr, rout_ptr, stride_x, stride_r, n_cols, eps,
                       HAS_RES: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
                       ZERO_CENTERED: tl.constexpr = False):
    if PDL:  # pdl.py: wait for the previous kernel, then let the next one start
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RES:
        x = x + tl.load(r_ptr + row * stride_r + cols, mask=mask, other=0.0)
        tl.store(rout_ptr + row * n_cols + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    if ZERO_CENTERED:  # Qwen3.5's norm: the weight stored as an offset from 1, the product in fp32, then the cast
        tl.store(out_ptr + row * n_cols + cols, (xf * rstd * (1.0 + w.to(tl.float32))).to(x.dtype), mask=mask)
    else:
        tl.store(out_ptr + row * n_cols + cols, (xf * rstd).to(x.dtype) * w, mask=mask)

@triton.jit
def silu_mul_kernel(gu_ptr, out_ptr, stride_gu, inter, BLOCK: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # pdl.py: wait for the previous kernel, then let the next one start
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    g = tl.load(gu_ptr + row * stride_gu + cols, mask=mask, other=0.0)
    u = tl.load(gu_ptr + row * stride_gu + inter + cols, mask=mask, other=0.0)
    gf = g.to(tl.float32)
    tl.store(out_ptr + row * inter + cols, (gf / (1.0 + tl.exp(-gf))).to(g.dtype) * u, mask=mask)


@triton.jit
def rope_halves(x1, x2, cos, sin, w_ptr, eps, D: tl.constexpr, QK_NORM: tl.constexpr, AXIS: tl.constexpr):
    """NeoX RoPE of heads given as their two halves (axis AXIS, the last, of D // 2; any axis before it runs over
    heads), after the per-head RMSNorm with the weight at w_ptr when QK_NORM. The one body of every kernel that
    rotates q or k, so a head's arithmetic is the same whichever kernel rotates it."""
    f1 = x1.to(tl.float32)
    f2 = x2.to(tl.float32)
    if QK_NORM:
        ss = tl.sum(f1 * f1, axis=AXIS, keep_dims=True) + tl.sum(f2 * f2, axis=AXIS, keep_dims=True)
        rstd = tl.rsqrt(ss / D + eps)
        half: tl.constexpr = D // 2
        w1 = tl.load(w_ptr + tl.arange(0, half))
        w2 = tl.load(w_ptr + half + tl.arange(0, half))
        f1 = ((f1 * rstd).to(x1.dtype) * w1).to(tl.float32)
        f2 = ((f2 * rstd).to(x1.dtype) * w2).to(tl.float32)
    o1 = (f1 * cos - f2 * sin).to(x1.dtype)
    o2 = (f2 * cos + f1 * sin).to(x1.dtype)
    return o1, o2


@triton.jit
def qk_rope_cache_kernel(qkv_ptr, pos_ptr, cos_ptr, sin_ptr, slot_ptr, kc_ptr, vc_ptr, qw_ptr, kw_ptr,
                         stride_t, num_q_heads, num_kv_heads, eps,
                         D: tl.constexpr, QK_NORM: tl.constexpr, WRITE_CACHE: tl.constexpr, PDL: tl.constexpr):
    """One program per (token, head) over q heads then k heads; q/k are rotated in place inside
    the fused qkv row [q | k | v]; a k head program also stores its k and v head in the cache."""
    if PDL:  # pdl.py: wait for the previous kernel, then let the next one start
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    half: tl.constexpr = D // 2
    d = tl.arange(0, half)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    cos = tl.load(cos_ptr + pos * D + d)
    sin = tl.load(sin_ptr + pos * D + d)
    is_k = h >= num_q_heads
    base = qkv_ptr + t * stride_t + h * D  # k heads follow the q heads in the row
    x1 = tl.load(base + d)
    x2 = tl.load(base + half + d)
    if is_k:
        o1, o2 = rope_halves(x1, x2, cos, sin, kw_ptr, eps, D, QK_NORM, 0)
    else:
        o1, o2 = rope_halves(x1, x2, cos, sin, qw_ptr, eps, D, QK_NORM, 0)
    tl.store(base + d, o1)
    tl.store(base + half + d, o2)
    if WRITE_CACHE:
        if is_k:
            kvh = h - num_q_heads
            slot = tl.load(slot_ptr + t).to(tl.int64)
            dst = slot * num_kv_heads * D + kvh * D
            tl.store(kc_ptr + dst + d, o1)
            tl.store(kc_ptr + dst + half + d, o2)
            vsrc = base + num_kv_heads * D
            full = tl.arange(0, D)
            tl.store(vc_ptr + dst + full, tl.load(vsrc + full))

@triton.jit
def argmax_partial_kernel(x_ptr, val_ptr, idx_ptr, stride, n, parts, BLOCK: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # pdl.py: wait for the previous kernel, then let the next one start
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1)
    cols = p * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(x_ptr + row * stride + cols, mask=cols < n, other=float("-inf")).to(tl.float32)
    v = tl.where(v != v, float("inf"), v)  # NaN ranks as +inf
    best = tl.max(v, axis=0)
    tl.store(val_ptr + row * parts + p, best)
    tl.store(idx_ptr + row * parts + p, tl.min(tl.where(v == best, cols, n), axis=0))

@triton.jit
def argmax_final_kernel(val_ptr, idx_ptr, out_ptr, n, parts, BLOCK_P: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # pdl.py: wait for the previous kernel, then let the next one start
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BLOCK_P)
    m = j < parts
    v = tl.load(val_ptr + row * parts + j, mask=m, other=float("-inf"))
    i = tl.load(idx_ptr + row * parts + j, mask=m, other=n)
    best = tl.max(v, axis=0)
    tl.store(out_ptr + row, tl.min(tl.where(v == best, i, n), axis=0).to(tl.int64))


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                zero_centered: bool = False):
    """normed = RMSNorm(x + residual); returns (normed, x + residual), or normed when residual is None.
    zero_centered: (1 + weight) multiplies the fp32 normed rows before the cast (qwen3_5_norms.py)."""
    n = x.shape[-1]
    x2 = x.reshape(-1, n)
    out = torch.empty_like(x2)
    rout = torch.empty_like(x2) if residual is not None else out
    r2 = residual.reshape(-1, n) if residual is not None else x2
    if x2.stride(-1) != 1 or r2.stride(-1) != 1:
        x2, r2 = x2.contiguous(), r2.contiguous()
    rows = x2.shape[0]
    if rows:
        add_rmsnorm_kernel[(rows,)](x2, r2, weight, out, rout, x2.stride(0), r2.stride(0), n, eps,
                                    HAS_RES=residual is not None, BLOCK=_pow2(n), ZERO_CENTERED=zero_centered,
                                    num_warps=4 if n <= 4096 else 8, **pdl.options(x.device))
    if residual is None:
        return out.view(x.shape)
    return out.view(x.shape), rout.view(x.shape)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    inter = gate_up.shape[-1] // 2
    g2 = gate_up.reshape(-1, 2 * inter)
    if g2.stride(-1) != 1:
        g2 = g2.contiguous()
    out = torch.empty(g2.shape[0], inter, dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    if g2.shape[0]:
        silu_mul_kernel[(g2.shape[0], -(-inter // block))](g2, out, g2.stride(0), inter, BLOCK=block,
                                                            **pdl.options(g2.device))
    return out.view(*gate_up.shape[:-1], inter)


def qk_rope_cache(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  num_q_heads: int, num_kv_heads: int, head_dim: int, k_cache: torch.Tensor | None,
                  v_cache: torch.Tensor | None, slots: torch.Tensor | None, q_weight: torch.Tensor | None,
                  k_weight: torch.Tensor | None, eps: float) -> None:
    """In place on the fused qkv rows [T, (Hq + 2 Hkv) * D]: q/k norm (if weights), RoPE on q and k;
    then, when a cache is given, k and v stored at `slots` (cache layout [blocks, block, Hkv, D])."""
    T = qkv.shape[0]
    if T == 0:
        return
    assert qkv.stride(-1) == 1 and cos.dtype == torch.float32 and cos.is_contiguous()
    write = k_cache is not None
    dummy = qkv
    qk_rope_cache_kernel[(T, num_q_heads + num_kv_heads)](
        qkv, positions, cos, sin, slots if write else positions, k_cache if write else dummy,
        v_cache if write else dummy, q_weight if q_weight is not None else dummy,
        k_weight if k_weight is not None else dummy, qkv.stride(0), num_q_heads, num_kv_heads, eps,
        D=head_dim, QK_NORM=q_weight is not None, WRITE_CACHE=write, num_warps=1 if head_dim <= 128 else 2,
        **pdl.options(qkv.device))


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """torch.argmax(logits, -1) for [rows, V] logits (first index on ties; NaN ranks as +inf)."""
    rows, n = logits.shape
    logits = aligned(logits if logits.stride(-1) == 1 else logits.contiguous())
    block = 4096
    parts = -(-n // block)
    vals = torch.empty(rows, parts, dtype=torch.float32, device=logits.device)
    idx = torch.empty(rows, parts, dtype=torch.int32, device=logits.device)
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows:
        launch = pdl.options(logits.device)
        argmax_partial_kernel[(rows, parts)](logits, vals, idx, logits.stride(0), n, parts, BLOCK=block, num_warps=8,
                                             **launch)
        argmax_final_kernel[(rows,)](vals, idx, out, n, parts, BLOCK_P=_pow2(parts), num_warps=1, **launch)
    return out
