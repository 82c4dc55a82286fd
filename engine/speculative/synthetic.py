"""An acceptance-controlled proposer, for measuring what a speculative round costs on a target without a
trained drafter.

It runs a real proposer's compute every round (n-gram lookup, or a DFlash drafter's forward of any shape, its
features recorded as usual) and then throws that draft away: it proposes the target's known continuation (greedy, or
sampled with the request's seed and settings) for its first n positions and a token the target does not pick after
them, so a round accepts exactly n drafts wherever the target reproduces its known output. n is `accepted` when that
is a whole number; a fractional `accepted` (3.25: acceptance length 4.25) spreads over each sequence's rounds (3, 3,
3, 4, ...: round r takes floor(a (r + 1)) - floor(a r)), so the mean is exact. The continuation comes from
`reference(seq)`: the tokens the target emits after `seq`'s current end. A benchmark records them from a target-only
run first; speculative method `synthetic` (engine/args.py) learns them (LearnedContinuations): a greedy or seeded
sampled request that finished teaches its prompt's continuation under its settings, so the first run of a prompt
drafts nothing and later runs of it are acceptance-controlled (contracts warm up on their timed prompts:
warmup_prompts timed). Everything it reports says `synthetic`: its figures measure the machinery, never what a
drafter achieves.
"""
from __future__ import annotations

import math
from collections.abc import Callable

import torch

from onecat.engine.speculative.base import Proposer
from onecat.engine.transfers import to_device


class LearnedContinuations:
    """The target's continuation of each prompt, from the requests that finished with it: greedy requests by
    prompt, seeded sampled ones by prompt, settings and seed (their draws are keyed by seed and position,
    core/keyed_draws.py, so the same request samples the same tokens again)."""

    def __init__(self) -> None:
        self._known: dict[tuple, list[int]] = {}

    @staticmethod
    def _key(seq) -> tuple | None:
        """Which later requests a finished one's output is theirs too; None when none is (an unseeded sampled
        request draws a fresh seed, one with logits processors depends on their state)."""
        p = seq.params
        if p.logits_processors or (not p.greedy and p.seed is None):
            return None
        how = () if p.greedy else (p.seed, p.temperature, p.top_p, p.top_k, p.min_p)
        return (tuple(seq.token_ids[:seq.num_prompt_tokens]), how)

    def __call__(self, seq) -> list[int]:
        key = self._key(seq)
        return self._known.get(key, [])[seq.num_output_tokens:] if key is not None else []

    def learn(self, seq) -> None:
        """Keep a finished request's output (the longest one seen per key); aborted ones teach nothing."""
        key = self._key(seq)
        if key is None or seq.finish_reason not in ("stop", "length"):
            return
        if len(seq.output_token_ids) > len(self._known.get(key, ())):
            self._known[key] = list(seq.output_token_ids)

    def __len__(self) -> int:
        return len(self._known)


class SyntheticProposer(Proposer):
    name = "synthetic"

    def __init__(self, compute: Proposer, accepted: float, reference: Callable[[object], list[int]], vocab_size: int):
        if accepted < 0:
            raise ValueError(f"accepted={accepted}: the drafts accepted per round cannot be negative")
        super().__init__(compute.k)
        self.compute, self.accepted, self.reference, self.vocab_size = compute, accepted, reference, vocab_size
        self.tap = compute.tap
        self._rounds: dict[str, int] = {}  # per request: rounds proposed so far

    @property
    def wants_features(self) -> bool:
        return self.compute.wants_features

    @property
    def drafts_on_device(self) -> bool:
        return self.compute.drafts_on_device

    @property
    def trims_drafts(self) -> bool:
        return self.compute.trims_drafts

    @property
    def graph_captures(self) -> int:
        return self.compute.graph_captures

    @property
    def one_off_work(self) -> int:
        return self.compute.one_off_work

    def defer_context(self, paused: bool) -> None:
        self.compute.defer_context(paused)

    @property
    def drafts_ahead(self) -> bool:
        return self.compute.drafts_ahead

    def draft_ahead(self, seqs, spans, accepted, bonus) -> None:
        self.compute.draft_ahead(seqs, spans, accepted, bonus)

    def record_features(self, seq, rows) -> None:
        self.compute.record_features(seq, rows)

    def propose(self, seqs, budgets):
        drafted = self.compute.propose(seqs, budgets)  # the real drafter's work, then its draft is replaced
        out = []
        for seq, budget, real in zip(seqs, budgets, drafted):
            n = min(budget, self.k) if (len(real) or not self.compute.wants_features) else 0
            known = self.reference(seq)[:n]
            if len(known) < n:  # past the recorded output: nothing known to propose
                n = len(known)
            r = self._rounds.get(seq.request_id, 0)
            self._rounds[seq.request_id] = r + 1
            right = math.floor(self.accepted * (r + 1)) - math.floor(self.accepted * r)
            draft = known[:right] + [(t + 1) % self.vocab_size for t in known[right:n]]
            if isinstance(real, torch.Tensor):  # where the drafter's drafts stay on the device, so do these
                draft = to_device(draft, real.device, torch.long)
            out.append(draft)
        return out

    def observe(self, seq, num_drafted: int, num_accepted: int) -> None:
        self.compute.observe(seq, num_drafted, num_accepted)

    def release(self, seq) -> None:
        if isinstance(self.reference, LearnedContinuations):
            self.reference.learn(seq)
        self._rounds.pop(seq.request_id, None)
        self.compute.release(seq)

    def describe(self) -> dict:
        learned = isinstance(self.reference, LearnedContinuations)
        return {"method": self.name, "synthetic": True, "accepted_per_round": self.accepted,
                "acceptance_length_set": self.accepted + 1, "num_speculative_tokens": self.k,
                "compute": self.compute.describe(), "reference": "learned" if learned else "given",
                **({"prompts_known": len(self.reference)} if learned else {})}
