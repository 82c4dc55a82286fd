"""CPU attention whose result for a query token does not depend on the batch or on the query length.

Padded SDPA (one [B, max_q] x [B, S] call per step) lets the kernel block the work by the step's
shape: the CPU flash kernel multiplies blocks of up to 32-256 query rows by blocks of up to 512 keys,
and the library GEMM sums in a different order for 1, 2..6 or 7+ rows and for other key-block
lengths. So a token's output moved (by ~1e-7) with the batch it shared a step with, and with whether
its prompt prefix came from the prefix cache (a shorter query).

Here the kernel sees fixed tiles instead: positions are cut into tiles of QUERY_TILE at multiples of
QUERY_TILE, and a tile is one batch entry whose rows are its tokens' query heads (those sharing a KV
head; rows of absent tokens are filler), over the sequence's keys padded (and masked) to a length set by
the tile alone. So every token is computed by the same kernel call shape, in the same row, on the same
numbers, whatever else the step holds. Tiles of equal key length go through one call.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from onecat.engine.attention.metadata import AttentionMetadata
from onecat.engine.cache.kv import LayerKVCache, dequantize_fp8

QUERY_TILE = 4  # tokens per kernel batch entry: more rows per matmul, more padding for a lone token
KEY_GRANULE = 64  # a tile's keys are padded to a multiple of this (a multiple of QUERY_TILE)

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def tile_keys(tile: int) -> int:
    """Padded key length of a tile: its last position + 1, rounded up to KEY_GRANULE."""
    last = tile * QUERY_TILE + QUERY_TILE - 1
    return (last // KEY_GRANULE + 1) * KEY_GRANULE


@dataclass
class _Call:
    seqs: int | slice | torch.Tensor  # one sequence (every tile is its own), or one sequence per tile
    keys: int
    tiles: int
    q_index: torch.Tensor  # [tiles * Hkv * QUERY_TILE] rows of the step's queries as [T * Hkv, G, D]
    out_index: torch.Tensor  # [tiles * QUERY_TILE * Hkv] where each result row goes (row T: discarded)
    mask: torch.Tensor  # [tiles, 1, QUERY_TILE * G, keys] additive
    typed: dict | None = None

    def mask_as(self, dtype: torch.dtype) -> torch.Tensor:
        """The mask in the queries' dtype, converted once per step (every layer reuses it)."""
        if self.typed is None:
            self.typed = {}
        if dtype not in self.typed:
            self.typed[dtype] = self.mask.to(dtype)
        return self.typed[dtype]


def _call(seqs, tiles: list[tuple[int, int, int, int]], keys: int, num_tokens: int, kv_heads: int,
          group: int) -> _Call:
    """tiles: (tile, first position, its query row, end position) of each tile's sequence. A tile row
    whose position is outside [first, end) repeats a present token's query; its result is discarded
    (rows of one matmul do not touch each other)."""
    sources, targets, pos = [], [], []
    for tile, first, q0, end in tiles:
        for p in range(tile * QUERY_TILE, tile * QUERY_TILE + QUERY_TILE):
            present = first <= p < end
            pos.append(p)
            sources.append(q0 + p - first if present else q0 + max(first, tile * QUERY_TILE) - first)
            targets.append(q0 + p - first if present else num_tokens)
    heads = torch.arange(kv_heads).view(1, -1, 1)
    q_index = (torch.tensor(sources).view(len(tiles), 1, QUERY_TILE) * kv_heads + heads).reshape(-1)
    out_index = (torch.tensor(targets).view(len(tiles), 1, QUERY_TILE) * kv_heads + heads).transpose(1, 2).reshape(-1)
    visible = torch.arange(keys).view(1, -1) <= torch.tensor(pos).view(-1, 1)
    mask = torch.zeros(visible.shape).masked_fill_(~visible, float("-inf"))
    mask = mask.view(len(tiles), 1, QUERY_TILE, 1, keys).expand(-1, -1, -1, group, -1)
    return _Call(seqs, keys, len(tiles), q_index, out_index, mask.reshape(len(tiles), 1, QUERY_TILE * group, keys))


def _step_plan(meta: AttentionMetadata, kv_heads: int, group: int) -> tuple[list[_Call], torch.Tensor, int]:
    """Per-step calls, shared by all layers: each sequence with several tiles alone (its tiles share its
    keys), the one-tile sequences together, both split by padded key length; and the KV blocks to
    gather, for the longest padded key length."""
    cached = meta.extras.get("batch_invariant_cpu")
    if cached is not None:
        return cached
    starts, q_lens, seq_lens = meta.query_start_loc.tolist(), meta.query_lens_cpu, meta.seq_lens_cpu
    T = starts[-1]
    calls, single = [], {}
    for b, (n, s) in enumerate(zip(q_lens, seq_lens)):
        first = s - n
        tiles = range(first // QUERY_TILE, (s - 1) // QUERY_TILE + 1)
        if len(tiles) == 1:
            single.setdefault(tile_keys(tiles[0]), []).append((b, (tiles[0], first, starts[b], s)))
            continue
        by_keys: dict[int, list] = {}
        for tile in tiles:
            by_keys.setdefault(tile_keys(tile), []).append((tile, first, starts[b], s))
        calls += [_call(b, run, keys, T, kv_heads, group) for keys, run in by_keys.items()]
    for keys, members in single.items():
        seqs = [b for b, _ in members]
        run = seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # consecutive: a slice of the gathered keys
        calls.append(_call(slice(seqs[0], seqs[0] + len(seqs)) if run else torch.tensor(seqs),
                           [t for _, t in members], keys, T, kv_heads, group))
    n_keys = max(c.keys for c in calls)
    plan = calls, _block_index(meta, n_keys), n_keys
    meta.extras["batch_invariant_cpu"] = plan
    return plan


def _block_index(meta: AttentionMetadata, n_keys: int) -> torch.Tensor | int:
    """The blocks holding each sequence's first n_keys keys, flattened ([B * n_blocks]); or, for one
    sequence whose blocks are consecutive, the first of them (its keys are then a view of the cache)."""
    B, n_blocks = meta.num_seqs, -(-n_keys // meta.block_size)
    if B == 1:
        used = -(-meta.seq_lens_cpu[0] // meta.block_size)
        own = meta.block_tables[0, :used].to(torch.int64)
        first = int(own[0])
        if torch.equal(own, torch.arange(first, first + used)):
            return first
    tables = meta.block_tables.to(torch.int64)[:, :n_blocks]
    if tables.shape[1] < n_blocks:  # pad with the null block
        tables = torch.cat([tables, tables.new_zeros(B, n_blocks - tables.shape[1])], dim=1)
    return tables.reshape(-1)


def _gather(cache: LayerKVCache, blocks: torch.Tensor | int, B: int, n_keys: int, dtype: torch.dtype):
    """Each sequence's first n_keys keys and values, [B, n_keys, Hkv, D]. A single sequence held in
    consecutive blocks is read in place: the cache from its first block on is its keys in order. Past its
    length that view shows whatever the next blocks hold, as the gather shows the null block there: finite
    numbers (the cache starts zeroed), masked to weight 0, so the result is the same to the bit."""
    n_blocks = -(-n_keys // cache.k.shape[1])
    if isinstance(blocks, int) and blocks + n_blocks > cache.k.shape[0]:  # the view would run off the end
        blocks = torch.arange(blocks, blocks + n_blocks).clamp_max_(cache.k.shape[0] - 1)
    if isinstance(blocks, int):
        first = blocks

        def pick(t: torch.Tensor) -> torch.Tensor:
            return t[first:first + n_blocks]
    else:
        def pick(t: torch.Tensor) -> torch.Tensor:
            return t.index_select(0, blocks)
    out = []
    for data, scale in ((cache.k, cache.k_scale), (cache.v, cache.v_scale)):
        x = pick(data)
        if cache.is_fp8:
            x = dequantize_fp8(x, pick(scale), cache.fp8_dtype, dtype)
        out.append(x.view(B, -1, *x.shape[-2:])[:, :n_keys])
    return out


def batch_invariant_attention(q: torch.Tensor, cache: LayerKVCache, meta: AttentionMetadata,
                              scale: float) -> torch.Tensor:
    """Paged attention for the step's T query tokens q: [T, Hq, D] -> [T, Hq, D]."""
    T, Hq, D = q.shape
    Hkv = cache.k.shape[2]
    G = Hq // Hkv
    calls, blocks, n_keys = _step_plan(meta, Hkv, G)
    k, v = _gather(cache, blocks, meta.num_seqs, n_keys, q.dtype)
    q_rows = q.reshape(-1, G, D)  # a view unless q is strided (q heads read in place from qkv rows)
    out = q.new_empty(T + 1, Hq, D)  # row T takes the results of padding rows
    for c in calls:
        n = c.tiles
        if isinstance(c.seqs, int):  # one sequence's tiles: its keys, shared (stride 0)
            ks = k[c.seqs:c.seqs + 1, :c.keys].expand(n, -1, -1, -1)
            vs = v[c.seqs:c.seqs + 1, :c.keys].expand(n, -1, -1, -1)
        elif isinstance(c.seqs, slice):
            ks, vs = k[c.seqs, :c.keys], v[c.seqs, :c.keys]
        else:
            ks, vs = k.index_select(0, c.seqs)[:, :c.keys], v.index_select(0, c.seqs)[:, :c.keys]
        qs = q_rows.index_select(0, c.q_index).view(n, Hkv, QUERY_TILE * G, D)
        o, _ = _flash(qs, ks.transpose(1, 2), vs.transpose(1, 2), attn_mask=c.mask_as(q.dtype), scale=scale)
        o = o.transpose(1, 2).view(n, QUERY_TILE, G, Hkv, D).transpose(2, 3).reshape(-1, G, D)
        out.view(-1, G, D).index_copy_(0, c.out_index, o)
    return out[:T]
