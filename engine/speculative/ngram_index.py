"""An incremental n-gram index of one sequence, for prompt lookup in O(max_n) a step.

Searching the whole sequence for its suffix every step costs O(length) (and, for a common first token,
a Python loop over every occurrence): at long contexts, or when nothing matches, that search is most of
what an n-gram proposer costs. The index keeps, per n, each n-gram's latest occurrence that something
follows, mapped to where that follower sits; each step adds only the n-grams its new tokens completed.
`lookup` answers exactly what a search of the whole sequence would (tests/test_ngram_index.py holds that
search as the reference).
"""
from __future__ import annotations


class NgramIndex:
    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        self._follower: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(min_n, max_n + 1)}
        self._upto = 0  # tokens[:_upto] have been indexed

    def extend(self, tokens: list[int]) -> None:
        """Index the n-grams that now have a follower: those ending at positions _upto - 1 .. len - 2."""
        for end in range(max(self._upto - 1, 0), len(tokens) - 1):
            for n, table in self._follower.items():
                if end - n + 1 >= 0:
                    table[tuple(tokens[end - n + 1:end + 1])] = end + 1  # a later occurrence replaces it
        self._upto = len(tokens)

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        """The k tokens after the latest earlier occurrence of the longest suffix n-gram (max_n .. min_n)."""
        if len(tokens) < self._upto:
            raise ValueError("the sequence got shorter than what was indexed; index a sequence that only grows")
        self.extend(tokens)
        L = len(tokens)
        for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):
            at = self._follower[n].get(tuple(tokens[L - n:]))
            if at is not None:
                return tokens[at:at + k]
        return []
