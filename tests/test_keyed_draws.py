"""Keyed draws (engine/core/keyed_draws.py): the hash gives the same values on Python ints, CPU and CUDA
tensors; its uniforms are uniform and unrelated across seeds, positions and token ids; each rule draws from
its row's distribution."""
from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare, kstest

from onecat.engine.core import keyed_draws
from onecat.engine.core.keyed_draws import draw, row_key, row_keys, uniforms


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_the_hash_is_the_same_on_ints_and_tensors(device):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    values = [0, 1, 2**31 - 1, 2**31, 2**32 - 1, 123456789, 0xDEADBEEF]
    on_device = keyed_draws._mix(torch.tensor(values, dtype=torch.int64, device=device)).tolist()
    assert on_device == [keyed_draws._mix(v) for v in values]
    assert all(0 <= v < 2**32 for v in on_device)
    keys = row_keys([5, 2**62 + 3, 0], [0, 17, 2**20], device)
    assert keys.tolist() == [row_key(5, 0), row_key(2**62 + 3, 17), row_key(0, 2**20)]
    u = uniforms(keys, torch.arange(7, device=device).expand(3, -1), 7)
    assert torch.equal(u.cpu(), uniforms(keys.cpu(), torch.arange(7).expand(3, -1), 7))
    lanes = [keyed_draws._mix(t) for t in range(7)]  # the per-vocabulary table holds each id's hash
    assert u.cpu()[1].tolist() == [(keyed_draws._mix(row_key(2**62 + 3, 17) ^ h) + 0.5) * 2.0 ** -32 for h in lanes]


def test_uniforms_are_uniform_and_unrelated_across_seeds_positions_and_ids():
    seeds = list(range(50)) * 20
    positions = [p for p in range(20) for _ in range(50)]
    u = uniforms(row_keys(seeds, positions, "cpu"), torch.arange(64).expand(len(seeds), -1), 64)  # [1000, 64]
    assert kstest(u.flatten().numpy(), "uniform").pvalue > 1e-3
    assert u.min() > 0 and u.max() < 1
    # neighbouring ids, positions and seeds: no correlation beyond sampling noise (~1/sqrt(n))
    centred = u - 0.5
    assert abs(float((centred[:, 1:] * centred[:, :-1]).mean())) / (1 / 12) < 0.02
    by_position = centred.view(20, 50, 64)
    assert abs(float((by_position[1:] * by_position[:-1]).mean())) / (1 / 12) < 0.02
    assert abs(float((by_position[:, 1:] * by_position[:, :-1]).mean())) / (1 / 12) < 0.02
    assert len({row_key(s, p) for s in range(200) for p in range(200)}) == 40000


@pytest.mark.parametrize("candidates", [False, True], ids=["whole-vocabulary", "candidates"])
def test_each_rule_draws_from_its_rows_distribution(candidates):
    g = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(12, generator=g) * 1.5, -1)
    probs[3] = 0.0
    probs /= probs.sum()
    n = 8000
    keys = row_keys(range(n), [9] * n, "cpu")
    if candidates:  # the same law over candidates in another order: the token ids decide the noise
        order = torch.randperm(12, generator=g)
        picked = order[draw(probs[order].expand(n, -1), order.expand(n, -1), keys, 12)]
    else:
        picked = draw(probs.expand(n, -1), None, keys, 12)
    counts = torch.bincount(picked, minlength=12).double()
    assert counts[3] == 0
    keep = probs > 0
    expected = probs[keep].double() / probs[keep].double().sum() * counts.sum()
    assert chisquare(counts[keep].numpy(), expected.numpy()).pvalue > 1e-3
