"""The fused MoE's pair sort (engine/kernels/triton_moe.align, plain torch: runs on CPU): every (token, expert)
pair lands once, in a row block of its own expert, in ascending pair order, padding rows hold the sentinel,
and blocks past the used rows are marked past the last expert."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")  # triton_moe holds the kernels too, so it imports Triton (kernels/triton_support.py)

from onecat.engine.kernels.triton_moe import align, down_tiles, max_padded_rows, tiles  # noqa: E402


@pytest.mark.parametrize("tokens,top_k,experts,block", [(1, 8, 128, 16), (5, 2, 8, 16), (37, 4, 16, 32),
                                                         (300, 8, 64, 64), (3, 3, 3, 4)])
def test_pairs_sorted_into_expert_blocks(tokens, top_k, experts, block):
    g = torch.Generator().manual_seed(tokens)
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    pairs, block_experts = align(ids, experts, block)
    n = tokens * top_k
    assert pairs.numel() == max_padded_rows(n, experts, block) == block_experts.numel() * block
    real = pairs[pairs < n]
    assert sorted(real.tolist()) == list(range(n))  # each pair exactly once
    assert ((pairs == n) | (pairs < n)).all()  # everything else is the padding sentinel
    flat = ids.reshape(-1)
    used_blocks = 0
    for b, e in enumerate(block_experts.tolist()):
        rows = pairs[b * block:(b + 1) * block]
        rows = rows[rows < n]
        if e == experts:  # past the end: nothing real may follow
            assert rows.numel() == 0
            continue
        used_blocks = b + 1
        assert (flat[rows] == e).all()
        assert rows.tolist() == sorted(rows.tolist())
    counts = torch.bincount(flat, minlength=experts)
    assert used_blocks == int(((counts + block - 1) // block).sum())


def test_one_expert_takes_every_token():
    ids = torch.full((50, 1), 3)
    pairs, block_experts = align(ids, 8, 16)
    assert block_experts.tolist()[:4] == [3, 3, 3, 3] and set(block_experts.tolist()[4:]) <= {8}
    assert pairs[:50].tolist() == list(range(50)) and (pairs[50:] == 50).all()


def test_tiles_grow_with_pairs_and_fma_keeps_small_tiles():
    assert tiles(8, "dot")["BM"] < tiles(100_000, "dot")["BM"]
    assert tiles(100_000, "fma")["BM"] == tiles(8, "fma")["BM"]


def test_down_tiles_change_one_decode_tier_at_a_time():
    """The down kernel's tiles are one set for every pair count of a tier (1 token and 32 tokens alike, so a token's
    sums do not depend on the batch): its own at decode pair counts, tiles()' elsewhere."""
    assert down_tiles(8, "dot") == down_tiles(256, "dot") != {k: tiles(8, "dot")[k] for k in down_tiles(8, "dot")}
    for pairs, variant in ((257, "dot"), (100_000, "dot"), (8, "fma"), (100_000, "fma")):
        t = tiles(pairs, variant)
        assert down_tiles(pairs, variant) == {k: t[k] for k in ("BN", "BK", "num_warps", "num_stages")}


def test_decode_gemv_tier_ends_where_the_dense_gemv_rows_end():
    """A decode step's MoE and dense projections are batch-invariant up to the same row count: the MoE GEMVs take
    up to triton_moe_gemv.MAX_TOKENS tokens, the dense GEMV up to triton_gemv.MAX_ROWS."""
    from onecat.engine.kernels import triton_gemv, triton_moe, triton_moe_gemv

    assert triton_moe_gemv.MAX_TOKENS == triton_gemv.MAX_ROWS
    assert triton_moe.takes_gemv(1) and triton_moe.takes_gemv(triton_moe_gemv.MAX_TOKENS)
    assert not triton_moe.takes_gemv(triton_moe_gemv.MAX_TOKENS + 1)
