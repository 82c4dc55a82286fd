"""The batched verifier: greedy blocks accept exactly the prefix equal to the target's argmax; sampled
blocks emit plain decoding's keyed draws (so the target's law) whatever the drafts; a seeded block's tokens
do not depend on the other blocks of its step."""
from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from onecat.engine import SamplingParams
from onecat.engine.core.keyed_draws import row_keys
from onecat.engine.core.sampler import sample
from onecat.engine.speculative.verifier import DraftBlock, verify_blocks

GREEDY = SamplingParams(temperature=0.0)
SAMPLED = SamplingParams(temperature=1.0)
TOP_K = SamplingParams(temperature=1.0, top_k=8)


def greedy_reference(draft: list[int], logits: torch.Tensor) -> list[int]:
    target = logits.argmax(dim=-1).tolist()
    a = 0
    while a < len(draft) and draft[a] == target[a]:
        a += 1
    return draft[:a] + [target[a]]


def law_fits(tokens: list[int], law: torch.Tensor) -> bool:
    counts = torch.bincount(torch.tensor(tokens), minlength=law.numel()).double()
    expected = law.double() / law.double().sum() * counts.sum()
    return chisquare(counts.numpy(), expected.numpy()).pvalue > 1e-3


def test_greedy_blocks_of_every_length_accept_their_matching_prefix():
    g = torch.Generator().manual_seed(0)
    blocks = []
    for k in [1, 3, 7, 2, 5, 4]:
        for accept in range(k + 1):
            logits = torch.randn(k + 1, 11, generator=g)
            target = logits.argmax(dim=-1).tolist()
            draft = [target[j] if j < accept else (target[j] + 1) % 11 for j in range(k)]
            blocks.append(DraftBlock(draft, logits, GREEDY))
    got = verify_blocks(blocks)
    assert got == [greedy_reference(b.draft, b.logits) for b in blocks]
    assert [len(t) - 1 for t in got] == [a for k in [1, 3, 7, 2, 5, 4] for a in range(k + 1)]


def keyed(logits: torch.Tensor, params: SamplingParams, seed: int, start: int) -> list[int]:
    """Plain decoding's draws at rows start, start + 1, ... of `logits` (one row a position)."""
    keys = row_keys([seed] * len(logits), list(range(start, start + len(logits))), "cpu")
    return sample(logits, [params] * len(logits), keys)


@pytest.mark.parametrize("with_q", [False, True])
def test_sampled_blocks_follow_the_target_law(with_q):
    """The first emitted token follows p at row 0, and the second (emitted only when draft 0 was
    accepted) follows p at row 1, for fixed drafts or drafts drawn from an unrelated q."""
    V, n = 5, 6000
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, V, generator=g) * 1.5
    p = logits.softmax(dim=-1)
    q = torch.tensor([[0.05, 0.6, 0.05, 0.2, 0.1], [0.3, 0.1, 0.4, 0.1, 0.1]])
    drafts = torch.multinomial(q, n, replacement=True, generator=g).T.tolist() if with_q else [[1, 2]] * n
    blocks = [DraftBlock(d, logits, SAMPLED, seed, 40) for seed, d in enumerate(drafts)]
    out = verify_blocks(blocks)
    assert law_fits([t[0] for t in out], p[0])
    after = [t[1] for t, d in zip(out, drafts) if t[0] == d[0]]
    assert len(after) > 500 and law_fits(after, p[1])
    assert any(len(t) == 1 for t in out) and any(len(t) == 3 for t in out)  # rejections and full accepts


@pytest.mark.parametrize("params", [SAMPLED, TOP_K, GREEDY], ids=["whole-vocabulary", "top-k", "greedy"])
def test_emitted_tokens_are_plain_decodings_whatever_the_drafts(params):
    """Drafter invariance: a block emits the tokens plain decoding draws at its positions for its seed, however
    many of its drafts match (none, some, all, or drafts drawn from another distribution)."""
    g = torch.Generator().manual_seed(4)
    for seed in range(40):
        logits = torch.randn(6, 50, generator=g) * 2
        plain = keyed(logits, params, seed, 100)
        other = torch.randn(6, 50, generator=g) * 2
        for draft in (plain[:5], plain[:2] + [(plain[2] + 1) % 50] + plain[3:5], [(t + 1) % 50 for t in plain[:5]],
                      keyed(other, params, seed, 100)[:5]):
            got = verify_blocks([DraftBlock(draft, logits, params, seed, 100)])[0]
            assert got == plain[:len(got)]
            assert got[:-1] == draft[:len(got) - 1]  # the accepted drafts, then the target's own token


def test_drafts_drawn_with_the_targets_keys_match_where_the_distributions_agree():
    """A drafter that draws with the target's keys: all accepted when q = p; with q near p, far more often than
    drafts drawn with other keys."""
    g = torch.Generator().manual_seed(5)
    same = near = unkeyed = 0
    for seed in range(300):
        logits = torch.randn(4, 40, generator=g) * 2
        close = logits + torch.randn(4, 40, generator=g) * 0.3
        same += len(verify_blocks([DraftBlock(keyed(logits, TOP_K, seed, 7)[:3], logits, TOP_K, seed, 7)])[0]) - 1
        near += len(verify_blocks([DraftBlock(keyed(close, TOP_K, seed, 7)[:3], logits, TOP_K, seed, 7)])[0]) - 1
        unkeyed += len(verify_blocks([DraftBlock(keyed(close, TOP_K, seed + 1000, 7)[:3], logits, TOP_K, seed,
                                                 7)])[0]) - 1
    assert same == 3 * 300
    assert near > 1.5 * unkeyed


def test_a_seeded_block_ignores_its_neighbours_and_order_is_kept():
    g = torch.Generator().manual_seed(2)
    mine = torch.randn(4, 9, generator=g)

    def alone():
        return verify_blocks([DraftBlock([3, 4, 5], mine, SAMPLED, 7, 30)])[0]

    others = [DraftBlock([1] * k, torch.randn(k + 1, 9, generator=g), params, k, 12)
              for k, params in [(6, SAMPLED), (2, GREEDY), (1, SAMPLED)]]
    mixed = others[:2] + [DraftBlock([3, 4, 5], mine, SAMPLED, 7, 30)] + others[2:]
    got = verify_blocks(mixed)
    assert got[2] == alone()
    assert got[1] == greedy_reference(others[1].draft, others[1].logits)
