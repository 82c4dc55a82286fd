"""The reference of the DFlash drafter's block attention kernel's tests (CPU under the interpreter, and GPU):
scaled_dot_product_attention in float32 over the concatenated context and block, each request's padding past its
length masked, the KV heads repeated for their query heads."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def reference(qkv, k_ctx, v_ctx, lens, nh, nkv, hd, B, scale):
    R, C = k_ctx.shape[:2]
    g = nh // nkv
    q = qkv[:, :nh * hd].float().view(R, B, nh, hd).transpose(1, 2)
    k = qkv[:, nh * hd:(nh + nkv) * hd].float().view(R, B, nkv, hd)
    v = qkv[:, (nh + nkv) * hd:].float().view(R, B, nkv, hd)
    keys = torch.cat([k_ctx.float(), k], 1).transpose(1, 2).repeat_interleave(g, 1)
    values = torch.cat([v_ctx.float(), v], 1).transpose(1, 2).repeat_interleave(g, 1)
    seen = torch.cat([torch.arange(C, device=qkv.device) < lens.long().unsqueeze(1),
                      torch.ones(R, B, dtype=torch.bool, device=qkv.device)], 1)
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=seen[:, None, None, :], scale=scale)
    return out.transpose(1, 2).reshape(R * B, nh * hd)
