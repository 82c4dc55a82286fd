"""The n-gram index answers exactly what a search of the whole sequence answers, step after step."""
from __future__ import annotations

import random

import numpy as np
import pytest

from onecat.engine.speculative.ngram_index import NgramIndex


def search(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The reference: the longest suffix n-gram (max_n .. min_n) found earlier in the whole sequence, with
    something after it; the k tokens after its latest such occurrence."""
    arr = np.asarray(tokens)
    L = len(arr)
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        suffix = arr[L - n:]
        for i in range(L - n - 1, -1, -1):
            if np.array_equal(arr[i:i + n], suffix):
                return arr[i + n:i + n + k].tolist()
    return []


@pytest.mark.parametrize("vocab,min_n,max_n", [(3, 1, 4), (8, 2, 3), (50, 1, 2), (2, 3, 5)])
def test_the_index_matches_the_search_as_a_sequence_grows(vocab, min_n, max_n):
    rng = random.Random(vocab * 100 + min_n)
    for _ in range(20):
        tokens = [rng.randrange(vocab) for _ in range(rng.randrange(1, 6))]
        index = NgramIndex(min_n, max_n)
        for _ in range(60):
            k = rng.randrange(1, 8)
            assert index.lookup(tokens, k) == search(tokens, min_n, max_n, k), tokens
            tokens = tokens + [rng.randrange(vocab) for _ in range(rng.choice((1, 1, 1, 3, 5)))]


def test_a_sequence_that_shrinks_is_refused():
    index = NgramIndex(1, 2)
    index.lookup([1, 2, 3, 1, 2], 2)
    with pytest.raises(ValueError, match="got shorter"):
        index.lookup([1, 2], 2)
