"""The prompt rows' attention on AMX bfloat16 tiles (csrc/cpu/amx_attention.cpp, paged_attention's tile_rows):
close to the float64 reference, each token's bits independent of its step (the batch, the run, the chunk of
the prompt that computes it), the rows past tile_rows exactly the float32 kernel's, and refusals that say why."""
from __future__ import annotations

import pytest
import torch

from onecat.engine.kernels import cpu_ops

pytestmark = pytest.mark.skipif(cpu_ops.unavailable_reason() is not None or
                                not cpu_ops.load().amx_bf16_isa(),
                                reason="needs the CPU ops on a CPU with AMX-BF16")
BS, BLOCKS = 16, 48


def _setup(group: int, dim: int, kv_heads: int = 2, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    k, v = (torch.randn(BLOCKS, BS, kv_heads, dim, generator=gen).to(torch.bfloat16) for _ in range(2))
    return gen, k, v


def _attend(q, k, v, q_lens, seq_lens, tables, tile_rows=None):
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    starts = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
    tiles = None if tile_rows is None else torch.tensor(tile_rows, dtype=torch.int64)
    return cpu_ops.load().paged_attention(q, k, v, None, None, 0, block_tables, starts,
                                          torch.tensor(seq_lens, dtype=torch.int32), 0.125, tiles)


def _reference(q, k, v, seq_len, table, scale=0.125):
    """float64 attention of a sequence's last q.shape[0] tokens over its keys 0..seq_len - 1."""
    heads, kv_heads = q.shape[1], k.shape[2]
    kb = k[table].reshape(-1, kv_heads, k.shape[-1])[:seq_len].double().repeat_interleave(heads // kv_heads, 1)
    vb = v[table].reshape(-1, kv_heads, v.shape[-1])[:seq_len].double().repeat_interleave(heads // kv_heads, 1)
    out = torch.empty(q.shape, dtype=torch.float64)
    for i in range(q.shape[0]):
        pos = seq_len - q.shape[0] + i
        scores = torch.einsum("hd,khd->hk", q[i].double(), kb[:pos + 1]) * scale
        out[i] = torch.einsum("hk,khd->hd", scores.softmax(-1), vb[:pos + 1])
    return out


@pytest.mark.parametrize("group,dim", [(3, 64), (1, 128), (4, 96), (8, 32)])
def test_a_prompt_on_tiles_is_close_to_the_reference(group, dim):
    gen, k, v = _setup(group, dim)
    table = [5, 17, 2, 40, 33, 8]
    q = torch.randn(83, 2 * group, dim, generator=gen)
    got = _attend(q, k, v, [83], [83], [table], [83])
    want = _reference(q, k, v, 83, table)
    err = (got.double() - want).abs().max().item()
    assert err < 2e-2, err  # bf16 queries and weights: ~3 significant digits
    assert torch.isfinite(got).all()


def test_a_tokens_bits_do_not_depend_on_its_step():
    """A 100-token prompt whole, in three chunks (a prefix cache hit, chunked prefill), and beside other
    sequences in a batch: every token the same bits."""
    gen, k, v = _setup(3, 64, seed=1)
    table = [9, 3, 17, 1, 25, 30, 11]
    q = torch.randn(100, 6, 64, generator=gen)
    whole = _attend(q, k, v, [100], [100], [table], [100])
    chunks = ((0, 7), (7, 40), (40, 100))
    parts = [_attend(q[a:b].contiguous(), k, v, [b - a], [b], [table], [b - a]) for a, b in chunks]
    assert torch.equal(torch.cat(parts), whole)
    other = torch.randn(20, 6, 64, generator=gen)
    batch = _attend(torch.cat([other, q[40:]]), k, v, [20, 60], [20, 100], [[44, 45], table], [20, 60])
    assert torch.equal(batch[20:], whole[40:])
    alone = [_attend(q[i:i + 1].contiguous(), k, v, [1], [i + 1], [table], [1]) for i in (0, 15, 16, 31, 32, 99)]
    assert all(torch.equal(a[0], whole[i]) for a, i in zip(alone, (0, 15, 16, 31, 32, 99)))


def test_rows_past_tile_rows_are_the_float32_kernels():
    """A step of a prompt's last chunk (its first 30 rows prompt rows), a sequence verifying drafts (no tile
    rows) and a decode row: the rows not on tiles are exactly what the kernel gives without tile_rows, and a
    bfloat16 query is answered in bfloat16."""
    gen, k, v = _setup(3, 64, seed=2)
    tables = [[1, 2, 3, 4], [10, 11, 12], [20, 21]]
    q = torch.randn(30 + 4 + 1, 6, 64, generator=gen)
    q_lens, seq_lens = [30, 4, 1], [50, 40, 20]
    plain = _attend(q, k, v, q_lens, seq_lens, tables)
    tiled = _attend(q, k, v, q_lens, seq_lens, tables, [30, 0, 0])
    assert torch.equal(tiled[30:], plain[30:])
    assert not torch.equal(tiled[:30], plain[:30])  # the tile rows took the other kernel
    assert (tiled[:30] - plain[:30]).abs().max() < 2e-2
    half = _attend(q.bfloat16(), k, v, q_lens, seq_lens, tables, [30, 0, 0])
    assert half.dtype == torch.bfloat16 and (half[:30].float() - tiled[:30]).abs().max() < 3e-2


def test_tile_rows_are_refused_where_they_cannot_run():
    gen, k, v = _setup(1, 64)
    q = torch.randn(4, 2, 64, generator=gen)
    with pytest.raises(RuntimeError, match="bfloat16 cache"):
        _attend(q, k.float(), v.float(), [4], [4], [[1]], [4])
    with pytest.raises(RuntimeError, match="within the sequence's query rows"):
        _attend(q, k, v, [4], [4], [[1]], [5])
    with pytest.raises(RuntimeError, match="one count per sequence"):
        _attend(q, k, v, [4], [4], [[1]], [4, 0])
