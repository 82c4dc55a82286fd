"""Reference attention in plain torch: gather each sequence's paged context, masked SDPA.

The context is gathered whole blocks at a time (a few large copies instead of one per token); keys
past a sequence's length are masked out. The gather indices and the causal/padding mask are built
once per step and shared by all layers. On CPU the batch-invariant path of batch_invariant_cpu.py
runs instead, so a token's output does not depend on what else is in the step.
"""
from __future__ import annotations

import torch

from onecat.engine.attention.backend import AttentionBackend
from onecat.engine.attention.batch_invariant_cpu import batch_invariant_attention
from onecat.engine.attention.metadata import AttentionMetadata
from onecat.engine.attention.sdpa import sdpa
from onecat.engine.cache.kv import LayerKVCache, dequantize_fp8


def _step_layout(meta: AttentionMetadata, device: torch.device) -> dict:
    """Padded [B, max_q] query layout, [B, n_blocks] gathered blocks and [B, 1, max_q, S] mask, where
    S = n_blocks * block_size covers the longest sequence."""
    cached = meta.extras.get("torch_ref")
    if cached is not None:
        return cached
    B, max_q, max_s, bs = meta.num_seqs, meta.max_query_len, meta.max_seq_len, meta.block_size
    seq_lens = meta.seq_lens.to(torch.int64)
    q_lens = torch.tensor(meta.query_lens_cpu, dtype=torch.int64, device=device)
    n_blocks = -(-max_s // bs)
    tables = meta.block_tables.to(torch.int64)[:, :n_blocks]
    if tables.shape[1] < n_blocks:  # pad with the null block
        tables = torch.cat([tables, tables.new_zeros(B, n_blocks - tables.shape[1])], dim=1)
    j = torch.arange(n_blocks * bs, device=device)
    i = torch.arange(max_q, device=device)
    q_pos = (seq_lens - q_lens).unsqueeze(1) + i.unsqueeze(0)  # [B, max_q] absolute positions
    mask = j.view(1, 1, -1) <= q_pos.unsqueeze(-1)  # causal; also excludes keys beyond seq_len
    valid_q = i.unsqueeze(0) < q_lens.unsqueeze(1)
    mask = mask | ~valid_q.unsqueeze(-1)  # padded query rows attend everywhere (discarded), avoids NaN
    starts = meta.query_start_loc[:-1].to(torch.int64)
    token_rows = (torch.arange(B, device=device).unsqueeze(1) * max_q + i.unsqueeze(0))[valid_q]
    layout = {"blocks": tables.reshape(-1), "mask": mask.unsqueeze(1), "token_rows": token_rows,
              "all_full": bool(valid_q.all()) and meta.is_pure_decode, "starts": starts}
    meta.extras["torch_ref"] = layout
    return layout


class TorchReferenceBackend(AttentionBackend):
    name = "TORCH_SDPA_REF"

    def unsupported_reason(self, q, cache, meta) -> str | None:
        return None

    def forward(self, q: torch.Tensor, cache: LayerKVCache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        if q.device.type == "cpu":
            return batch_invariant_attention(q, cache, meta, scale)
        T, Hq, D = q.shape
        B, max_q = meta.num_seqs, meta.max_query_len
        lay = _step_layout(meta, q.device)
        blocks = lay["blocks"]  # index_select: advanced indexing into a large cache is far slower
        Hkv = cache.k.shape[2]
        S = lay["mask"].shape[-1]
        k = cache.k.index_select(0, blocks)
        v = cache.v.index_select(0, blocks)
        if cache.is_fp8:
            k = dequantize_fp8(k, cache.k_scale.index_select(0, blocks), cache.fp8_dtype, q.dtype)
            v = dequantize_fp8(v, cache.v_scale.index_select(0, blocks), cache.fp8_dtype, q.dtype)
        k, v = k.view(B, S, Hkv, D), v.view(B, S, Hkv, D)
        if max_q == 1:
            qp = q.view(B, 1, Hq, D)
        else:
            qp = q.new_zeros(B * max_q, Hq, D)
            qp[lay["token_rows"]] = q
            qp = qp.view(B, max_q, Hq, D)
        out = sdpa(
            qp.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=lay["mask"], scale=scale,
            enable_gqa=Hkv != Hq)
        out = out.transpose(1, 2).reshape(B * max_q, Hq, D)
        return out if max_q == 1 else out[lay["token_rows"]]
