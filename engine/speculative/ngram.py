"""Prompt-lookup (n-gram) proposer: copy what followed the latest earlier occurrence of the suffix.

With `adaptive`, each sequence's k starts at `num_speculative_tokens` and doubles after a fully
accepted draft (up to `max_speculative_tokens`), halving again after an early rejection — long
verbatim copies then move many tokens per target pass.
"""
from __future__ import annotations

import numpy as np

from onecat.engine.core.sequence import Sequence
from onecat.engine.speculative.base import Proposer


def find_continuation(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """Longest suffix n-gram (max_n..min_n) found earlier in `tokens`; the k tokens after its last match."""
    L = len(tokens)
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        suffix = tokens[L - n:]
        # candidate starts i with tokens[i:i+n] == suffix and i + n < L (something follows)
        hits = np.flatnonzero(tokens[:L - n] == suffix[0])
        for i in hits[::-1]:
            if i + n < L and np.array_equal(tokens[i:i + n], suffix):
                return tokens[i + n:i + n + k].tolist()
    return []


class NgramProposer(Proposer):
    name = "ngram"

    def __init__(self, k: int, prompt_lookup_min: int = 1, prompt_lookup_max: int = 4, adaptive: bool = False,
                 max_speculative_tokens: int | None = None):
        super().__init__(max_speculative_tokens or k if adaptive else k)
        self.base_k, self.min_n, self.max_n, self.adaptive = k, prompt_lookup_min, prompt_lookup_max, adaptive
        self.current_k: dict[str, int] = {}

    def propose(self, seqs, budgets):
        out = []
        for seq, budget in zip(seqs, budgets):
            k = min(budget, self.current_k.get(seq.request_id, self.base_k) if self.adaptive else budget)
            toks = np.asarray(seq.token_ids, dtype=np.int64)
            out.append((find_continuation(toks, self.min_n, self.max_n, k), None))
        return out

    def observe(self, seq: Sequence, num_drafted: int, num_accepted: int) -> None:
        if not self.adaptive:
            return
        k = self.current_k.get(seq.request_id, self.base_k)
        if num_drafted and num_accepted == num_drafted:
            k = min(self.k, 2 * k)
        elif num_accepted < num_drafted // 2:
            k = max(self.base_k, k // 2)
        self.current_k[seq.request_id] = k

    def release(self, seq: Sequence) -> None:
        self.current_k.pop(seq.request_id, None)

    def describe(self) -> dict:
        return {"method": self.name, "num_speculative_tokens": self.base_k, "prompt_lookup_min": self.min_n,
                "prompt_lookup_max": self.max_n, "adaptive": self.adaptive, "max_speculative_tokens": self.k}
