"""The batched verifier: greedy blocks accept exactly the prefix equal to the target's argmax; sampled
blocks emit the target's law whatever the proposer's q; a seeded block's tokens do not depend on the
other blocks of its step."""
from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from onecat.engine import SamplingParams
from onecat.engine.speculative.verifier import DraftBlock, verify_blocks

GREEDY = SamplingParams(temperature=0.0)
SAMPLED = SamplingParams(temperature=1.0)


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


@pytest.mark.parametrize("with_q", [False, True])
def test_sampled_blocks_follow_the_target_law(with_q):
    """The first emitted token follows p at row 0, and the second (emitted only when draft 0 was
    accepted) follows p at row 1, for a point-mass or a wrong q."""
    V, n = 5, 6000
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, V, generator=g) * 1.5
    p = logits.softmax(dim=-1)
    q = torch.tensor([[0.05, 0.6, 0.05, 0.2, 0.1], [0.3, 0.1, 0.4, 0.1, 0.1]]) if with_q else None
    # a proposer with q draws its drafts from q; a point-mass proposer always drafts the same tokens
    drafts = torch.multinomial(q, n, replacement=True, generator=g).T.tolist() if with_q else [[1, 2]] * n
    blocks = [DraftBlock(d, logits, SAMPLED, torch.Generator().manual_seed(s), q) for s, d in enumerate(drafts)]
    out = verify_blocks(blocks)
    assert law_fits([t[0] for t in out], p[0])
    after = [t[1] for t, d in zip(out, drafts) if t[0] == d[0]]
    assert len(after) > 500 and law_fits(after, p[1])
    assert any(len(t) == 1 for t in out) and any(len(t) == 3 for t in out)  # rejections and full accepts


def test_a_seeded_block_ignores_its_neighbours_and_order_is_kept():
    g = torch.Generator().manual_seed(2)
    mine = torch.randn(4, 9, generator=g)

    def alone():
        return verify_blocks([DraftBlock([3, 4, 5], mine, SAMPLED, torch.Generator().manual_seed(7))])[0]

    others = [DraftBlock([1] * k, torch.randn(k + 1, 9, generator=g), params, torch.Generator().manual_seed(k))
              for k, params in [(6, SAMPLED), (2, GREEDY), (1, SAMPLED)]]
    mixed = others[:2] + [DraftBlock([3, 4, 5], mine, SAMPLED, torch.Generator().manual_seed(7))] + others[2:]
    got = verify_blocks(mixed)
    assert got[2] == alone()
    assert got[1] == greedy_reference(others[1].draft, others[1].logits)
