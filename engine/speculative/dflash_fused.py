"""The DFlash drafter's block forward with fused kernels: drafting on a GPU, where a round's block (16 rows
a request) is too small for its math to matter and each kernel's launch and tail set its time.

Per layer, eleven kernels instead of about fifty: the input norm with the previous layer's residual add
(add_rmsnorm), q/k/v in one matmul over stacked weights, q/k norm and RoPE in one kernel (qk_rope_cache,
no cache write), attention over [context ; block] by the block attention kernel's two launches (keys read where
they lie, split over programs; engine/kernels/triton_block_attention.py) or, where it does not run, one
scaled_dot_product_attention call over the concatenation (the query heads grouped per key/value head, the
context's padding masked), o_proj, the post-attention residual add with its
norm, gate/up, SiLU*mul, down; with ONECAT_ROWS_GEMM=1 the matmuls run the few-row GEMM
(engine/kernels/triton_rows_gemm.py), which also takes SiLU*mul into gate/up: ten. The same math as DFlashDrafter.forward_cached, rounded in other places
(tests/test_dflash_fused.py). Inference only (training takes the reference path, whose gradients reach
every weight), and only where the drafter's norms run the fused Triton kernels (`use_fused`, set from the
target's fused-kernel choice) and every row has its own context (S == R: drafting, never training's packing).
On a CPU the same path runs the fused C++ ops (their `cpu_ops`, float32, set likewise): the norms with their
residual adds, q/k norm + RoPE in one call (qk_norm_rope), SiLU*mul, and q/k/v in one call of the rows kernel
over the stacked weights; there a block's ~50 eager ops a layer cost more than its matmuls (a round's drafter
took ~5 ms, of which the matmuls ~2).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from onecat.engine.kernels.device import capability
from onecat.engine.layers.linear import project
from onecat.engine.switches import switch


FUSED_FLAG = "ONECAT_DFLASH_FUSED"  # 0: the drafter drafts through the reference ops on a GPU too (A/B)
# the block's attention by the split kernel (engine/kernels/triton_block_attention.py) where the fused kernels run;
# 0: one scaled_dot_product_attention call over the concatenated context and block (A/B)
BLOCK_ATTENTION = switch("ONECAT_DRAFTER_BLOCK_ATTENTION", True)


def fused_forward_applies(drafter, block_embeds: torch.Tensor, contexts: int) -> bool:
    """`use_fused` is set on CUDA only (DFlashProposer); tests set it to run the kernels under Triton's interpreter.
    `cpu_ops` (the fused C++ ops) on a CPU, for float32 blocks."""
    if torch.is_grad_enabled() or contexts != block_embeds.shape[0]:
        return False
    if drafter.norm.use_fused:
        return True
    return not block_embeds.is_cuda and drafter.norm.cpu_ops is not None and block_embeds.dtype == torch.float32


def _block_attention_tiling(drafter, layer_kv, dtype: torch.dtype) -> tuple[int, int] | None:
    """The block attention kernel's tiling for this call (None: SDPA runs it): BLOCK_ATTENTION on, context K/V of
    the block's dtype with each position's heads contiguous, a power-of-two head size (one a tl.arange spans), and
    a tiling for the device (triton_block_attention.config; Triton's interpreter in tests: SM80+'s)."""
    hd = drafter.layers[0].self_attn.hd
    k, v = layer_kv[0]
    if not (BLOCK_ATTENTION and (hd & (hd - 1)) == 0 and hd >= 16 and k.dtype == v.dtype == dtype
            and k.stride(-1) == v.stride(-1) == 1 and k.stride(2) == v.stride(2) == hd):
        return None
    from onecat.engine.kernels.triton_block_attention import config

    return config(hd, capability(k.device.index or 0) if k.is_cuda else 90)


def _visible(layer_kv, ctx_len: torch.Tensor, R: int, B: int, always: bool) -> torch.Tensor | None:
    """The SDPA path's mask [R, 1, 1, C + B] (context rows below each length, the whole block); None where every
    row sees its whole context and `always` is off (one request on a CPU: attention without a mask)."""
    C = layer_kv[0][0].shape[1] if layer_kv else 0
    ctx_visible = torch.arange(C, device=ctx_len.device) < ctx_len.unsqueeze(1)
    if not always and bool(ctx_visible.all()):
        return None
    return torch.cat([ctx_visible, ctx_visible.new_ones(R, B)], dim=1)[:, None, None, :]


def _stacked_qkv(attn) -> torch.Tensor:
    """[q_proj; k_proj; v_proj] weights in one matrix (rebuilt when a weight was replaced or changed)."""
    params = (attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight)
    key = tuple((t.data_ptr(), t._version) for t in params)
    if getattr(attn, "_qkv_key", None) != key:
        attn._qkv = torch.cat(params)
        attn._qkv_key = key
    return attn._qkv


def _qkv(layer, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(q/k/v of input_layernorm(x + residual), x + residual): one matmul over the stacked weights (a drafter
    quantized at load: its stacked packed layer, drafter_quant.py)."""
    attn, norm = layer.self_attn, layer.input_layernorm
    h, residual = (norm(x), x) if residual is None else norm(x, residual)
    packed = getattr(attn, "qkv_packed", None)
    if packed is not None:
        return packed(h), residual
    qkv = project(h, _stacked_qkv(attn), None, attn.q_proj.use_fused, owner=attn)
    if attn.q_proj.bias is not None:
        qkv = qkv + torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias])
    return qkv, residual


def _attention(attn, qkv: torch.Tensor, pos: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_ctx: torch.Tensor,
               v_ctx: torch.Tensor, seen: "_Seen") -> torch.Tensor:
    """o_proj of the block's attention over [context ; block]: by the block attention kernel where it runs, else
    one scaled_dot_product_attention call over the concatenation under `seen`'s mask."""
    nh, nkv, hd = attn.nh, attn.nkv, attn.hd
    R, B = seen.R, seen.B
    g = nh // nkv
    if attn.q_norm.use_fused:  # Triton (CUDA, or its interpreter in tests)
        from onecat.engine.kernels.triton_fused import qk_rope_cache

        qk_rope_cache(qkv, pos, cos, sin, nh, nkv, hd, None, None, None, attn.q_norm.weight, attn.k_norm.weight,
                      attn.q_norm.eps)
    else:
        attn.q_norm.cpu_ops.qk_norm_rope(qkv, pos, cos, sin, nh, nkv, attn.q_norm.weight, attn.k_norm.weight,
                                         attn.q_norm.eps)
    if seen.tiling is not None and qkv.dtype == k_ctx.dtype and qkv.stride(-1) == 1:
        from onecat.engine.kernels.triton_block_attention import block_attention

        return attn.o_proj(block_attention(qkv, k_ctx, v_ctx, seen.lens(), nh, nkv, hd, B, attn.scale, seen.tiling))
    q = qkv[:, :nh * hd].view(R, B, nkv, g, hd).permute(0, 2, 3, 1, 4).reshape(R, nkv, g * B, hd)
    k = qkv[:, nh * hd:(nh + nkv) * hd].view(R, B, nkv, hd)
    v = qkv[:, (nh + nkv) * hd:].view(R, B, nkv, hd)
    keys = torch.cat([k_ctx, k], dim=1).transpose(1, 2)  # [R, nkv, C + B, hd]
    values = torch.cat([v_ctx, v], dim=1).transpose(1, 2)
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=seen.mask(), scale=attn.scale)  # [R, nkv, gB, hd]
    out = out.view(R, nkv, g, B, hd).permute(0, 3, 1, 2, 4).reshape(R * B, nh * hd)
    return attn.o_proj(out)


class _Seen:
    """What each block row sees, as the attention path asks for it, made once a forward: the kernel's int32
    lengths (and its `tiling`, None where it does not run) or SDPA's mask [R, 1, 1, C + B] (None where every row
    sees its whole context on a CPU: attention without a mask)."""

    def __init__(self, drafter, layer_kv, ctx_len: torch.Tensor, R: int, B: int, dtype: torch.dtype):
        self.layer_kv, self.ctx_len, self.R, self.B = layer_kv, ctx_len, R, B
        self.always = ctx_len.is_cuda or drafter.norm.use_fused
        self.tiling = _block_attention_tiling(drafter, layer_kv, dtype) if drafter.norm.use_fused else None
        self._lens = self._mask = None
        self._masked = False

    def lens(self) -> torch.Tensor:
        if self._lens is None:
            self._lens = self.ctx_len.to(torch.int32)
        return self._lens

    def mask(self) -> torch.Tensor | None:
        if not self._masked:
            self._mask, self._masked = _visible(self.layer_kv, self.ctx_len, self.R, self.B, self.always), True
        return self._mask


def forward_fused(drafter, block_embeds: torch.Tensor, block_pos: torch.Tensor,
                  layer_kv: list[tuple[torch.Tensor, torch.Tensor]], ctx_len: torch.Tensor) -> torch.Tensor:
    """DFlashDrafter.forward_cached's result ([R, B, H] after the final norm) through the fused kernels."""
    R, B, H = block_embeds.shape
    seen = _Seen(drafter, layer_kv, ctx_len, R, B, block_embeds.dtype)
    pos = block_pos.reshape(R * B)
    cos, sin = drafter.rotary.cos, drafter.rotary.sin
    x, residual = block_embeds.reshape(R * B, H), None
    for layer, (k_ctx, v_ctx) in zip(drafter.layers, layer_kv):
        qkv, residual = _qkv(layer, x, residual)  # [T, (nh + 2 nkv) hd]
        x = _attention(layer.self_attn, qkv, pos, cos, sin, k_ctx, v_ctx, seen)
        x, residual = layer.mlp.after_norm(layer.post_attention_layernorm, x, residual)
    out = drafter.norm(x) if residual is None else drafter.norm(x, residual)[0]
    return out.view(R, B, H)
