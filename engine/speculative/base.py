"""Proposer interface and the engine-facing speculative decoder (propose -> schedule -> verify)."""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from onecat.engine.scheduler import ScheduledSeq
from onecat.engine.sequence import Sequence
from onecat.engine.speculative.verifier import verify_greedy, verify_sampled


class Proposer(ABC):
    """Proposes up to `k` next tokens per sequence. `q` probabilities are None for deterministic drafts."""

    name = "abstract"

    def __init__(self, k: int):
        self.k = k

    @abstractmethod
    def propose(self, seqs: list[Sequence], budgets: list[int]) -> list[tuple[list[int], torch.Tensor | None]]:
        """One (draft tokens, q probs [len, V] or None) per sequence, each at most its budget long."""

    def observe(self, seq: Sequence, num_drafted: int, num_accepted: int) -> None:
        """Feedback after verification (adaptive proposers widen or narrow their k)."""

    def release(self, seq: Sequence) -> None:
        """The sequence finished: drop any per-sequence state."""

    def describe(self) -> dict:
        return {"method": self.name, "num_speculative_tokens": self.k}


class SpeculativeDecoder:
    def __init__(self, proposer: Proposer, max_model_len: int):
        self.proposer = proposer
        self.max_model_len = max_model_len
        self.k = proposer.k

    def lookahead(self, running: list[Sequence]) -> dict[str, int]:
        """Draft for every running sequence that is decoding; returns the KV slots each needs."""
        seqs, budgets = [], []
        for seq in running:
            seq.draft_tokens, seq.draft_probs = [], None
            if seq.num_tokens - seq.num_computed_tokens != 1 or seq.params.prompt_logprobs is not None:
                continue
            if seq.params.extra.get("logits_processors"):  # verification does not run them: no drafts
                continue
            p = seq.params
            left = (p.max_tokens - seq.num_output_tokens) if p.max_tokens is not None else self.k + 1
            budget = min(self.k, left - 1, self.max_model_len - seq.num_tokens - 1)
            if budget > 0:
                seqs.append(seq)
                budgets.append(budget)
        if not seqs:
            return {}
        result = {}
        for seq, (draft, q) in zip(seqs, self.proposer.propose(seqs, budgets)):
            if draft:
                seq.draft_tokens, seq.draft_probs = draft, q
                result[seq.request_id] = len(draft)
        return result

    def verify(self, seq: Sequence, sched: ScheduledSeq, logits: torch.Tensor) -> list[int]:
        draft = seq.draft_tokens[:sched.num_lookahead]
        if seq.params.greedy:
            tokens = verify_greedy(draft, logits)
        else:
            q = seq.draft_probs[:len(draft)] if seq.draft_probs is not None else None
            tokens = verify_sampled(draft, q, logits, seq.params, seq.generator)
        accepted = len(tokens) - 1
        s = seq.spec
        s.num_drafts += 1
        s.num_draft_tokens += len(draft)
        s.num_accepted_tokens += accepted
        if len(s.accepted_per_position) < self.k:
            s.accepted_per_position.extend([0] * (self.k - len(s.accepted_per_position)))
        for j in range(accepted):
            s.accepted_per_position[j] += 1
        self.proposer.observe(seq, len(draft), accepted)
        seq.draft_tokens, seq.draft_probs = [], None
        return tokens

    def release(self, seq: Sequence) -> None:
        self.proposer.release(seq)

    def describe(self) -> dict:
        return self.proposer.describe()
