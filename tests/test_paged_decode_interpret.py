"""The split-KV paged decode (engine/kernels/triton_paged_decode.py) under Triton's interpreter (CPU): the merge done
by each (token, KV head)'s last split program (MERGE_IN_SPLIT) gives the merge kernel's result, over contexts that
end on and off partition and block edges, several split programs per token and several partitions per program, the
long sequences' longer partitions (a row of each kind in one launch), the verify layout (work items naming their
token and sequence), and fp16 against a float64 softmax; the counters are all zero again after every launch. (The
GPU's bits and the CUDA-graph replay are checked in tests/test_gpu_engine.py.)"""
from __future__ import annotations

import pytest
from triton_interpret import run_interpreted

pytest.importorskip("triton")

SCRIPT = r"""
import torch
from onecat.engine.cache.kv import LayerKVCache
from onecat.engine.kernels import triton_paged_decode as tpd

g = torch.Generator().manual_seed(0)
H, KVH, D, PAGE = 4, 2, 32, 16
for lens, rows_per_seq, long_from in [([1, 15, 16, 129, 300, 700], 1, 8192), ([40, 260], 3, 8192),
                                      ([100, 300, 700, 1100], 1, 256), ([250, 700], 3, 256)]:
    tpd.LONG_FROM, tpd.LONG_PARTITION = long_from, 512  # lowered: contexts past 256 tokens take 512-token ones
    blocks = sum(-(-s // PAGE) for s in lens) + 3
    k = torch.randn(blocks, PAGE, KVH, D, generator=g).half()
    v = torch.randn(blocks, PAGE, KVH, D, generator=g).half()
    cache = LayerKVCache(k, v, None, None, None)
    order = (torch.randperm(blocks - 1, generator=g) + 1).tolist()
    tables = [[order.pop() for _ in range(-(-s // PAGE))] for s in lens]
    width = max(map(len, tables))
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    # work items: each sequence's last rows_per_seq tokens, token j seeing its context up to itself
    items = [(i, s - rows_per_seq + 1 + j) for i, s in enumerate(lens) for j in range(rows_per_seq)]
    n = len(items)
    ctx = torch.tensor([c for _, c in items], dtype=torch.int32)
    row = torch.tensor([i for i, _ in items], dtype=torch.int32)
    tok = torch.arange(n, dtype=torch.int32)
    q = torch.randn(n, H, D, generator=g).half()
    indirect = rows_per_seq > 1
    got = {}
    for fused in (True, False):  # fused first: no partials of this problem lie in freed memory yet
        tpd.MERGE_IN_SPLIT = fused
        out = torch.zeros(n, H, D, dtype=torch.half)
        if indirect:
            tpd.paged_decode(out, q, cache, bt, ctx, max(lens), D ** -0.5, tok_idx=tok, row_idx=row)
        else:
            tpd.paged_decode(out, q, cache, bt, ctx, max(lens), D ** -0.5)
        got[fused] = out
        if fused:
            assert int(tpd._COUNTERS[torch.device("cpu")].abs().sum()) == 0
    assert torch.equal(got[True], got[False]), (got[True] - got[False]).abs().max()
    for t, (i, c) in enumerate(items):
        slots = [tables[i][p // PAGE] * PAGE + p % PAGE for p in range(c)]
        kk = k.view(-1, KVH, D)[slots].double().repeat_interleave(H // KVH, 1)  # [c, H, D]
        vv = v.view(-1, KVH, D)[slots].double().repeat_interleave(H // KVH, 1)
        w = torch.softmax(torch.einsum("hd,chd->hc", q[t].double(), kk) * D ** -0.5, -1)
        ref = torch.einsum("hc,chd->hd", w, vv)
        assert (got[True][t].double() - ref).abs().max() < 5e-3, (lens, t)
print("ok")
"""


def test_the_last_split_program_merges_as_the_merge_kernel_does():
    run_interpreted(SCRIPT)
