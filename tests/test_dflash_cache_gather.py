"""The DFlash drafter cache's gathering of queued feature spans (engine/speculative/dflash_cache.py `_gathered`)
against a plain reference: spans of several step tensors, requests interleaved as a batch queues them a row per
step, multi-row spans (prefill chunks, verify steps), a request whose positions jump (a prefix-cache skip) or step
back (recomputed after preemption)."""
from __future__ import annotations

import random
from types import SimpleNamespace

import torch

from onecat.engine.core.sequence import FeatureRows
from onecat.engine.speculative.dflash_cache import DrafterKVCache


def reference(pending):
    """Row by row: each request's spans in the order queued, a new run where its positions do not continue."""
    sources, total = {}, 0
    for _, _, r in pending:
        if id(r.source) not in sources:
            sources[id(r.source)] = total
            total += r.source.shape[0]
    runs: dict[str, list] = {}
    for request_id, start, r in pending:
        mine = runs.setdefault(request_id, [])
        rows = [sources[id(r.source)] + r.first + j for j in range(r.count)]
        if mine and mine[-1][0] + len(mine[-1][1]) == start:
            mine[-1][1].extend(rows)
        else:
            mine.append([start, rows])
    index, positions, out = [], [], []
    for request_id, mine in runs.items():
        for start, rows in mine:
            out.append((request_id, start, len(index), len(rows)))
            index += rows
            positions += range(start, start + len(rows))
    return index, positions, out


def _queue(seed: int):
    rng = random.Random(seed)
    steps = [torch.randn(rng.randint(3, 9), 4) for _ in range(6)]
    at = {f"r{i}": rng.randint(0, 50) for i in range(4)}
    pending = []
    for source in steps:
        first = 0
        for request_id in rng.sample(sorted(at), k=rng.randint(1, 3)):
            count = rng.randint(1, min(3, source.shape[0] - first)) if first < source.shape[0] else 0
            if not count:
                break
            jump = rng.choice([0, 0, 0, 5, -2])  # continue, or skip ahead, or recompute from an earlier position
            at[request_id] = max(0, at[request_id] + jump)
            pending.append((request_id, at[request_id], FeatureRows(source, first, count)))
            at[request_id] += count
            first += count
    return pending


def test_gathered_spans_are_the_reference_rows_positions_and_runs():
    cache = SimpleNamespace(device=torch.device("cpu"))
    for seed in range(40):
        pending = _queue(seed)
        feats, positions, runs = DrafterKVCache._gathered(cache, pending)
        index, want_positions, want_runs = reference(pending)
        sources = []
        for _, _, r in pending:
            if all(r.source is not s for s in sources):
                sources.append(r.source)
        assert torch.equal(feats, torch.cat(sources)[index]), seed
        assert positions.tolist() == want_positions and runs == want_runs, seed


def test_a_batch_queued_a_row_per_step_keeps_each_request_in_one_run():
    steps = [torch.randn(3, 2) for _ in range(5)]
    pending = [(rid, 10 * i + s, FeatureRows(t, i, 1)) for s, t in enumerate(steps) for i, rid in enumerate("abc")]
    feats, positions, runs = DrafterKVCache._gathered(SimpleNamespace(device=torch.device("cpu")), pending)
    assert runs == [("a", 0, 0, 5), ("b", 10, 5, 5), ("c", 20, 10, 5)]
    assert positions.tolist() == [*range(0, 5), *range(10, 15), *range(20, 25)]
    assert torch.equal(feats[5:10], torch.stack([t[1] for t in steps]))
