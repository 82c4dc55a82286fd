"""The small ops around Qwen3.5's gated full attention in two kernels (CUDA, Triton).

Between qkv_proj and the paged attention the torch path runs some thirty kernels a layer: the per-head
zero-centered q and k norms (each a handful of casts, a mean and products), the partial RoPE on their first
`rotary_dim` dims (table lookups, products, a roll, a cat), the query's copy out of its place beside the gate,
and the K/V cache write (with an fp8 cache: the per-token-head amax, scale and cast of k and v, four scatter
copies); after attention, the gate's copy, sigmoid and product. Here:

  qk_norm_rope_cache  one program per (token, head) over the query heads then the KV heads: the zero-centered
                      RMSNorm of the head, RoPE (half split) on its first R dims; a query head is written to a
                      contiguous q, a KV head's k (and its v) to the paged cache at the token's slot, as
                      float8 bytes with one fp32 scale per token and head where the cache is fp8 (the scale and
                      rounding of engine/cache/kv.py quantize_fp8).
  sigmoid_gate        attention output * SIGMOID(gate), the gate read in place beside the query in qkv.

Values are rounded where the torch path (engine/layers/gated_attention.py, qwen3_5_norms.py, rotary.py)
rounds them (the norm's output, the rotary tables, each RoPE product and sum, the sigmoid); the sums of squares
run in another order, so results agree with the torch path to the last bit of those roundings, not always bit
for bit. A token's values depend on that token alone.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from onecat.engine.kernels import pdl
from onecat.engine.kernels.triton_gated_delta_step import _rounded


@triton.jit
def qk_norm_rope_cache_kernel(qkv_ptr, pos_ptr, cos_ptr, sin_ptr, slot_ptr, q_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr,
                              qw_ptr, kw_ptr, stride_t, eps, fp8_max, H: tl.constexpr, HKV: tl.constexpr,
                              D: tl.constexpr, R: tl.constexpr, BREST: tl.constexpr, FP8: tl.constexpr,
                              PDL: tl.constexpr):
    if PDL:  # pdl.py: wait for the previous kernel, then let the next one start
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    HALF: tl.constexpr = R // 2
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    is_k = h >= H
    dt = qkv_ptr.dtype.element_ty
    row = qkv_ptr + t * stride_t
    # a query head sits beside its gate ([q | gate] per head); the k heads follow the 2 H D of them
    if is_k:
        base = row + 2 * H * D + (h - H) * D
        w_ptr = kw_ptr
    else:
        base = row + h * 2 * D
        w_ptr = qw_ptr
    c = tl.arange(0, HALF)
    rest = R + tl.arange(0, BREST)
    rest_ok = rest < D
    xa = tl.load(base + c).to(tl.float32)
    xb = tl.load(base + HALF + c).to(tl.float32)
    xr = tl.load(base + rest, mask=rest_ok, other=0.0).to(tl.float32)
    rstd = tl.rsqrt((tl.sum(xa * xa, 0) + tl.sum(xb * xb, 0) + tl.sum(xr * xr, 0)) / D + eps)
    # the zero-centered norm: (1 + w) multiplies the fp32 normed values, then the cast (ZeroCenteredRMSNorm)
    ya = _rounded(xa * rstd * (1.0 + tl.load(w_ptr + c).to(tl.float32)), dt)
    yb = _rounded(xb * rstd * (1.0 + tl.load(w_ptr + HALF + c).to(tl.float32)), dt)
    yr = (xr * rstd * (1.0 + tl.load(w_ptr + rest, mask=rest_ok, other=0.0).to(tl.float32))).to(dt)
    # RoPE on the first R dims as rotary.py rotates: x * cos + roll(x, R/2) * [-sin | sin], the tables cast to
    # the model dtype, each product and the sum rounded
    pos = tl.load(pos_ptr + t).to(tl.int64)
    cos_a = _rounded(tl.load(cos_ptr + pos * R + c), dt)
    cos_b = _rounded(tl.load(cos_ptr + pos * R + HALF + c), dt)
    sin_a = _rounded(tl.load(sin_ptr + pos * R + c), dt)
    sin_b = _rounded(tl.load(sin_ptr + pos * R + HALF + c), dt)
    oa = (_rounded(ya * cos_a, dt) + _rounded(-(yb * sin_a), dt)).to(dt)
    ob = (_rounded(yb * cos_b, dt) + _rounded(ya * sin_b, dt)).to(dt)
    if is_k:
        kvh = h - H
        slot = tl.load(slot_ptr + t).to(tl.int64)
        at = (slot * HKV + kvh) * D
        vsrc = row + 2 * H * D + HKV * D + kvh * D
        va = tl.load(vsrc + c)
        vb = tl.load(vsrc + HALF + c)
        vr = tl.load(vsrc + rest, mask=rest_ok, other=0.0)
        k_scale = _store_head(kc_ptr + at, c, rest, rest_ok, oa, ob, yr, fp8_max, HALF, FP8)
        v_scale = _store_head(vc_ptr + at, c, rest, rest_ok, va, vb, vr, fp8_max, HALF, FP8)
        if FP8:
            tl.store(ks_ptr + slot * HKV + kvh, k_scale)
            tl.store(vs_ptr + slot * HKV + kvh, v_scale)
    else:
        _store_head(q_ptr + (t * H + h) * D, c, rest, rest_ok, oa, ob, yr, fp8_max, HALF, 0)


@triton.jit
def _store_head(ptr, c, rest, rest_ok, a, b, r, fp8_max, HALF: tl.constexpr, FP8: tl.constexpr):
    """One head's values (the rotary part's halves a and b, then the rest r) at ptr: as they are, or (FP8 1:
    e4m3fn, 2: e5m2) as float8 bytes of x / scale with one scale, amax / the format's max (quantize_fp8), which
    it returns."""
    if FP8:
        amax = tl.maximum(tl.maximum(tl.max(tl.abs(a.to(tl.float32)), 0), tl.max(tl.abs(b.to(tl.float32)), 0)),
                          tl.max(tl.abs(r.to(tl.float32)), 0))
        scale = tl.maximum(amax / fp8_max, 1e-12)
        a, b, r = _fp8_bytes(a, scale, FP8), _fp8_bytes(b, scale, FP8), _fp8_bytes(r, scale, FP8)
    else:
        scale = 1.0
    tl.store(ptr + c, a)
    tl.store(ptr + HALF + c, b)
    tl.store(ptr + rest, r, mask=rest_ok)
    return scale


@triton.jit
def _fp8_bytes(x, scale, FP8: tl.constexpr):
    """x / scale in float32 rounded to the float8 format (1: e4m3fn, 2: e5m2), as its bytes."""
    y = x.to(tl.float32) / scale
    if FP8 == 1:
        return y.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    return y.to(tl.float8e5).to(tl.uint8, bitcast=True)


@triton.jit
def sigmoid_gate_kernel(o_ptr, qkv_ptr, out_ptr, stride_t, H: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr,
                        PDL: tl.constexpr):
    """out[t] = o[t] * SIGMOID(gate[t]), the gate of head h at qkv[t, (2h + 1) D ...]."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    t = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = i < H * D
    o = tl.load(o_ptr + t * H * D + i, mask=ok, other=0.0)
    g = tl.load(qkv_ptr + t * stride_t + (i // D) * 2 * D + D + i % D, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * H * D + i, o * (1.0 / (1.0 + tl.exp(-g))).to(o.dtype), mask=ok)


FP8_FORMATS = {torch.float8_e4m3fn: 1, torch.float8_e5m2: 2}


def unsupported_reason(head_dim: int, rotary_dim: int, fp8_dtype: torch.dtype | None,
                       device: torch.device) -> str | None:
    """Why the kernels cannot take this attention's shape and cache (None: they can)."""
    if rotary_dim < 2 or rotary_dim % 2 or rotary_dim > head_dim or (rotary_dim // 2) & (rotary_dim // 2 - 1):
        return f"rotary_dim {rotary_dim}: a power-of-two half of at most head_dim is needed"
    if fp8_dtype is not None and device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        return "Triton converts to float8 on compute capability 8.9 and later only"
    return None


def qk_norm_rope_cache(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int,
                       kv_heads: int, head_dim: int, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
                       cache, slots: torch.Tensor) -> torch.Tensor:
    """From qkv_proj's rows [T, 2 H D + 2 Hkv D] ([q | gate] per head, then k, v): the normed, rotated queries
    [T, H, D] (returned), and k / v stored in `cache` (engine/cache/kv.py LayerKVCache) at `slots`."""
    tokens, rotary = qkv.shape[0], cos.shape[-1]
    q = torch.empty(tokens, heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    if tokens == 0:
        return q
    if qkv.stride(-1) != 1 or not (cos.is_contiguous() and sin.is_contiguous()):
        raise ValueError("qkv's columns and the rotary tables must be contiguous")
    fp8 = FP8_FORMATS[cache.fp8_dtype] if cache.is_fp8 else 0
    scales = (cache.k_scale, cache.v_scale) if fp8 else (cos, cos)
    qk_norm_rope_cache_kernel[(tokens, heads + kv_heads)](
        qkv, positions, cos, sin, slots, q, cache.k, cache.v, *scales, q_weight, k_weight, qkv.stride(0), eps,
        float(torch.finfo(cache.fp8_dtype).max) if fp8 else 0.0, H=heads, HKV=kv_heads, D=head_dim, R=rotary,
        BREST=triton.next_power_of_2(max(head_dim - rotary, 1)), FP8=fp8, num_warps=1 if head_dim <= 256 else 2,
        **pdl.options(qkv.device))
    return q


def sigmoid_gate(out: torch.Tensor, qkv: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    """out [T, H D] * SIGMOID(gate), the gates read beside the queries in qkv_proj's rows."""
    tokens, width = out.shape[0], heads * head_dim
    result = torch.empty(tokens, width, dtype=out.dtype, device=out.device)
    if tokens:
        block = min(1024, triton.next_power_of_2(width))
        sigmoid_gate_kernel[(tokens, triton.cdiv(width, block))](out.reshape(tokens, width).contiguous(), qkv,
                                                                 result, qkv.stride(0), H=heads, D=head_dim,
                                                                 BLOCK=block, **pdl.options(out.device))
    return result
