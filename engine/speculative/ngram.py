"""Prompt-lookup (n-gram) proposer: copy what followed the latest earlier occurrence of the suffix
(the longest of prompt_lookup_max .. prompt_lookup_min tokens), found through a per-request index
(ngram_index.py) that each step extends by the new tokens only.

With `adaptive`, each sequence's k starts at `num_speculative_tokens` and doubles after a fully
accepted draft (up to `max_speculative_tokens`), halving again after an early rejection — long
verbatim copies then move many tokens per target pass.
"""
from __future__ import annotations

from onecat.engine.core.sequence import Sequence
from onecat.engine.speculative.base import Proposer
from onecat.engine.speculative.ngram_index import NgramIndex


class NgramProposer(Proposer):
    name = "ngram"
    looks_up_on_host = True  # a dictionary lookup on the token lists: the decode pipeline may ask it in flight

    def __init__(self, k: int, prompt_lookup_min: int = 1, prompt_lookup_max: int = 4, adaptive: bool = False,
                 max_speculative_tokens: int | None = None):
        super().__init__(max_speculative_tokens or k if adaptive else k)
        self.base_k, self.min_n, self.max_n, self.adaptive = k, prompt_lookup_min, prompt_lookup_max, adaptive
        self.current_k: dict[str, int] = {}
        self.indexes: dict[str, NgramIndex] = {}  # per request: its n-grams, grown a step at a time

    def propose(self, seqs, budgets):
        out = []
        for seq, budget in zip(seqs, budgets):
            k = min(budget, self.current_k.get(seq.request_id, self.base_k) if self.adaptive else budget)
            index = self.indexes.get(seq.request_id)
            if index is None:
                index = self.indexes[seq.request_id] = NgramIndex(self.min_n, self.max_n)
            out.append(index.lookup(seq.token_ids, k))
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
        self.indexes.pop(seq.request_id, None)

    def describe(self) -> dict:
        return {"method": self.name, "num_speculative_tokens": self.base_k, "prompt_lookup_min": self.min_n,
                "prompt_lookup_max": self.max_n, "adaptive": self.adaptive, "max_speculative_tokens": self.k}
