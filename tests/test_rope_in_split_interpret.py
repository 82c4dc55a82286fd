"""A pure decode step's RoPE and K/V store done by the paged decode's split kernel (`paged_decode(new=...)`,
engine/kernels/triton_paged_decode.py) under Triton's interpreter (CPU): the same attention output and the
same cache, bit for bit, as qk_rope_cache followed by paged_decode; with and without Qwen3's q/k norm, GQA
groups of 1, 2 and 3 query heads, contexts that end on and off partition and block edges, and one sequence
alone (eight split programs) as well as six (two each, several partitions a program), with the merge kernel and
with the merge in the split kernel. Only the program whose splits hold the token's position stores its K/V, so
the others must never need them."""
from __future__ import annotations

import pytest
from triton_interpret import run_interpreted

pytest.importorskip("triton")

SCRIPT = r"""
import torch
from onecat.engine.cache.kv import LayerKVCache
from onecat.engine.kernels import triton_paged_decode as tpd
from onecat.engine.kernels.triton_fused import qk_rope_cache
from onecat.engine.layers.rotary import RotaryEmbedding

g = torch.Generator().manual_seed(0)
D, PAGE = 32, 16
rot = RotaryEmbedding(D, 10000.0, 1024, None)
for H, KVH, norm, lens in [(4, 2, False, [1, 15, 16, 129, 300, 700]), (6, 2, True, [129, 17, 256, 5, 640, 2]),
                           (3, 3, False, [900]), (4, 4, True, [3, 300])]:
    n = len(lens)
    blocks = sum(-(-s // PAGE) for s in lens) + 3
    k0 = torch.randn(blocks, PAGE, KVH, D, generator=g).half()
    v0 = torch.randn(blocks, PAGE, KVH, D, generator=g).half()
    order = (torch.randperm(blocks - 1, generator=g) + 1).tolist()
    tables = [[order.pop() for _ in range(-(-s // PAGE))] for s in lens]
    width = max(map(len, tables))
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    ctx = torch.tensor(lens, dtype=torch.int32)
    pos = (ctx - 1).long()
    slots = torch.tensor([tables[i][(s - 1) // PAGE] * PAGE + (s - 1) % PAGE for i, s in enumerate(lens)])
    qkv = torch.randn(n, (H + 2 * KVH) * D, generator=g).half()
    qw = (1 + 0.1 * torch.randn(D, generator=g)).half() if norm else None
    kw = (1 + 0.1 * torch.randn(D, generator=g)).half() if norm else None
    # reference: the separate kernel rotates in place and stores K/V, then attention reads them
    ref_qkv, ref_k, ref_v = qkv.clone(), k0.clone(), v0.clone()
    qk_rope_cache(ref_qkv, pos, rot.cos, rot.sin, H, KVH, D, ref_k, ref_v, slots, qw, kw, 1e-6)
    ref = torch.zeros(n, H, D, dtype=torch.half)
    tpd.paged_decode(ref, ref_qkv[:, :H * D].view(n, H, D), LayerKVCache(ref_k, ref_v, None, None, None), bt, ctx,
                     max(lens), D ** -0.5)
    # in the split kernel: q and the new k/v straight from the projection's rows; with the merge in the split
    # kernel too (its last program overwrites the output rows where the others put their rotated q)
    for merge in (False, True):
        tpd.MERGE_IN_SPLIT = merge
        k, v = k0.clone(), v0.clone()
        got = torch.zeros(n, H, D, dtype=torch.half)
        new = tpd.NewTokens(qkv[:, H * D:], pos, rot.cos, rot.sin, slots, qw, kw, 1e-6)
        tpd.paged_decode(got, qkv[:, :H * D].view(n, H, D), LayerKVCache(k, v, None, None, None), bt, ctx,
                         max(lens), D ** -0.5, new=new)
        assert torch.equal(k, ref_k) and torch.equal(v, ref_v), (H, KVH, norm, merge)
        assert torch.equal(got, ref), (H, KVH, norm, merge, (got - ref).abs().max())
        assert not torch.equal(k, k0)  # the new tokens' K did land in the cache
    tpd.MERGE_IN_SPLIT = False
try:
    tpd.paged_decode(got, qkv[:, :H * D].view(n, H, D), LayerKVCache(k, v, None, None, None), bt, ctx, max(lens),
                     D ** -0.5, tok_idx=torch.arange(n, dtype=torch.int32), row_idx=torch.arange(n, dtype=torch.int32),
                     new=new)
except ValueError as e:
    assert "pure decode" in str(e)
else:
    raise AssertionError("a verify layout with new tokens was accepted")
print("ok")
"""


def test_split_kernel_rotates_and_stores_the_new_token_as_qk_rope_cache_does():
    run_interpreted(SCRIPT, timeout=600)
