"""The sampler's filters (engine/core/sampler.py) look for each row's top-k / nucleus among its largest logits
instead of sorting the vocabulary: the same distribution as the sorted definition, rows whose nucleus reaches past
the candidates sorted whole, a row's result independent of its batch, and draws that follow the distribution."""
from __future__ import annotations

import pytest
import torch

from onecat.engine.core import sampler
from onecat.engine.core.keyed_draws import draw, row_keys
from onecat.engine.core.sampler import apply_filters, sample
from onecat.engine.sampling_params import SamplingParams

V = 5000


def sorted_reference(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The definition on one row: sort the whole vocabulary, keep the top k, then every token whose mass strictly
    ahead is at most top_p (the first always), then min_p against the most likely token."""
    x = logits / (1.0 if p.greedy else p.temperature)
    vals, order = x.sort(descending=True)
    k = p.top_k if 0 < p.top_k < V else V
    keep = torch.arange(V) < k
    probs = vals.masked_fill(~keep, float("-inf")).softmax(-1)
    if p.top_p < 1.0:
        keep &= (probs.cumsum(-1) - probs) <= p.top_p
    keep[0] = True
    probs = vals.masked_fill(~keep, float("-inf")).softmax(-1)
    if p.min_p > 0:
        probs = torch.where(probs >= p.min_p * probs.max(), probs, torch.zeros_like(probs))
        probs = probs / probs.sum()
    return torch.zeros(V).scatter(0, order, probs)


def _rows(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    peaky = torch.randn(n, V, generator=g) * 4
    flat = torch.randn(n, V, generator=g) * 0.05  # a nucleus of thousands of tokens: past the candidates
    return torch.cat([peaky, flat])


SETTINGS = [dict(temperature=0.8, top_p=0.95), dict(temperature=1.0, top_k=20), dict(temperature=1.0, top_k=20,
            top_p=0.9), dict(temperature=0.7, top_p=0.9, min_p=0.05), dict(temperature=1.3),
            dict(temperature=1.0, top_k=3000, top_p=0.99), dict(temperature=0.0)]


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
def test_filters_equal_the_sorted_definition(setting, monkeypatch):
    monkeypatch.setattr(sampler, "CANDIDATES", 256)
    logits = _rows(6, 0)
    params = [SamplingParams(**setting)] * len(logits)
    got = apply_filters(logits, params)
    for row, p in zip(range(len(logits)), params):
        want = sorted_reference(logits[row], p)
        assert torch.equal(got[row] > 0, want > 0), f"row {row}: another set of tokens kept"
        torch.testing.assert_close(got[row], want, rtol=1e-5, atol=1e-7)


def test_a_flat_rows_nucleus_is_looked_for_in_the_whole_vocabulary(monkeypatch):
    monkeypatch.setattr(sampler, "CANDIDATES", 256)
    logits = _rows(2, 1)
    groups = sampler.filtered(logits, [SamplingParams(temperature=1.0, top_p=0.9)] * len(logits))
    widths = {tuple(rows): probs.shape[1] for rows, probs, _ in groups}
    assert widths == {(0, 1): 256, (2, 3): V}
    assert all(int((p > 0).sum()) > 256 for rows, p, _ in groups if p.shape[1] == V)


def test_sorting_top_p_rows_whole_keeps_the_same_tokens_and_draws(monkeypatch):
    """A GPU sorts every top-p row without top-k whole (no read-back of whether its nucleus fits the candidates):
    the same distributions and the same keyed draws as the candidates' path the CPU takes."""
    monkeypatch.setattr(sampler, "CANDIDATES", 256)
    logits = _rows(8, 3)
    params = [SamplingParams(temperature=t, top_p=p, seed=i) for i, (t, p) in
              enumerate([(0.8, 0.95), (1.0, 0.9), (0.6, 0.5), (1.2, 0.99)] * 4)]
    params[5] = SamplingParams(temperature=1.0, top_k=20, top_p=0.9, seed=5)  # has a top-k: candidates either way
    sorted_groups = sampler.filtered(logits, params, sort_top_p=True)
    assert {tuple(rows): p.shape[1] for rows, p, _ in sorted_groups} == \
        {(5,): 256, tuple(i for i in range(len(params)) if i != 5): V}
    real = sampler.filtered
    dists, draws = {}, {}
    for sort_top_p in (False, True):
        monkeypatch.setattr(sampler, "filtered", lambda x, ps, _s=sort_top_p: real(x, ps, sort_top_p=_s))
        dists[sort_top_p] = apply_filters(logits, params)
        draws[sort_top_p] = [sample(logits, params, row_keys([p.seed for p in params], [pos] * len(params), "cpu"))
                             for pos in range(40)]
    assert torch.equal(dists[True] > 0, dists[False] > 0)
    torch.testing.assert_close(dists[True], dists[False], rtol=1e-5, atol=1e-7)
    assert draws[True] == draws[False]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_rows_distribution_and_draw_do_not_depend_on_its_batch(monkeypatch, device):
    monkeypatch.setattr(sampler, "CANDIDATES", 256)
    logits = _rows(3, 2).to(device)
    params = [SamplingParams(temperature=0.9, top_p=0.95, seed=i) for i in range(len(logits))]
    whole = apply_filters(logits, params)
    keys = lambda rows: row_keys([100 + i for i in rows], [7] * len(rows), device)  # noqa: E731
    together = sample(logits, params, keys(range(len(logits))))
    for i in range(len(logits)):
        assert torch.equal(apply_filters(logits[i:i + 1], params[i:i + 1])[0], whole[i])
        assert sample(logits[i:i + 1], params[i:i + 1], keys([i])) == [together[i]]


@pytest.mark.parametrize("setting", [dict(temperature=1.0, top_k=8, top_p=0.9), dict(temperature=2.0)])
def test_draws_follow_the_filtered_distribution(setting):
    torch.manual_seed(0)
    row = torch.randn(1, V) * 3
    if "top_k" not in setting:
        row[0, 10:] = -30.0  # temperature alone: the mass on ten tokens, so each is checked
    p = SamplingParams(**setting)
    want = apply_filters(row, [p])[0]
    n = 6000
    tokens = sample(row.expand(n, V), [p] * n, row_keys(range(n), [0] * n, "cpu"))
    counts = torch.bincount(torch.tensor(tokens), minlength=V).float() / n
    assert set(torch.nonzero(counts).flatten().tolist()) <= set(torch.nonzero(want).flatten().tolist())
    assert (counts - want).abs().max() < 4 * (want * (1 - want) / n).sqrt().max() + 1e-3


@pytest.mark.parametrize("candidates", [False, True], ids=["whole-vocabulary", "candidates"])
def test_a_draw_never_lands_on_a_token_of_zero_probability(candidates):
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0, 0.0]] * 64)
    ids = torch.arange(6).expand(64, -1) if candidates else None
    assert set(draw(probs, ids, row_keys(range(64), [3] * 64, "cpu"), 6).tolist()) == {1, 3}
    one = torch.tensor([[0.0, 0.0, 1.0, 0.0]])
    assert draw(one, torch.arange(4)[None] if candidates else None, row_keys([5], [0], "cpu"), 4).tolist() == [2]


def test_a_row_without_top_k_or_top_p_keeps_every_token_next_to_rows_that_have_them(monkeypatch):
    monkeypatch.setattr(sampler, "CANDIDATES", 256)
    logits = _rows(2, 3)
    params = [SamplingParams(temperature=0.9, top_p=0.9), SamplingParams(temperature=0.9),
              SamplingParams(temperature=0.9, top_k=20), SamplingParams(temperature=0.9, top_k=40, top_p=0.5)]
    together = apply_filters(logits, params)
    assert int((together[1] > 0).sum()) == V
    for i, p in enumerate(params):
        alone = apply_filters(logits[i:i + 1], [p])[0]
        assert torch.equal(together[i], alone)
        torch.testing.assert_close(alone, sorted_reference(logits[i], p), rtol=1e-5, atol=1e-7)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="captures CUDA work: needs a CUDA GPU")
def test_a_failed_sampling_graph_capture_falls_back_to_eager_draws(monkeypatch):
    """A batch whose draws cannot be captured (here the capture is refused: torch.cuda.CUDAGraph raises) keeps its
    eager draws: the same tokens, the graphs turned off with the reason in describe()."""
    from onecat.engine.core import sampler_graphs

    def refused():
        raise RuntimeError("capture refused")

    monkeypatch.setattr(sampler_graphs.torch.cuda, "CUDAGraph", refused)
    device = "cuda"
    logits = _rows(2, 4).to(device)
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=i) for i in range(len(logits))]
    keys = row_keys([p.seed for p in params], [3] * len(params), device)
    graphs = sampler_graphs.SamplerGraphs()
    want = sampler.sample_on_device(logits, params, keys)
    for _ in range(3):  # seen once, then a capture is tried (and fails), then eager for good
        assert torch.equal(graphs.sample(logits, params, keys), want)
    described = graphs.describe()
    assert described["captured"] == 0 and described["replays"] == 0 and "capture failed" in described["disabled_reason"]


def test_logits_off_a_gpu_are_drawn_eagerly_never_captured():
    """A capture records CUDA work only: logits on the CPU (a CPU engine, or a GPU machine's CPU tensors) always draw
    eagerly, and the graphs stay on for CUDA batches."""
    from onecat.engine.core.sampler_graphs import SamplerGraphs

    logits = _rows(2, 4)
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=i) for i in range(len(logits))]
    keys = row_keys([p.seed for p in params], [3] * len(params), "cpu")
    graphs = SamplerGraphs()
    for _ in range(3):
        assert torch.equal(graphs.sample(logits, params, keys), sampler.sample_on_device(logits, params, keys))
    assert graphs.describe() == {"captured": 0, "replays": 0, "kept": 0}
