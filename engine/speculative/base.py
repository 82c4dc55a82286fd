"""Proposer interface and the engine-facing speculative decoder (propose -> schedule -> verify).

The engine core talks only to `SpeculativeDecoder`: `lookahead` (draft, and the KV slots the drafts
need), `verify`, `release`, `describe`, and, for block drafters conditioned on the target's hidden
states, `wants_features` / `step_features` / `record_features`.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Protocol, runtime_checkable

import torch

from onecat.engine.core.scheduler_output import ScheduledSeq
from onecat.engine.core.sequence import FeatureRows, Sequence
from onecat.engine.errors import ConfigError
from onecat.engine.speculative.controller import SpeculationGate
from onecat.engine.speculative.draft_length import DraftLengths
from onecat.engine.speculative.draft_ahead import VerifiedRead
from onecat.engine.speculative.verifier import Draft, DraftBlock, emitted_tokens, verified_on_device
from onecat.engine.switches import switch


@runtime_checkable
class HiddenStateTap(Protocol):
    """A target model that keeps, from its last forward pass, the hidden states after the layers in
    `aux_layer_ids`: `aux_hidden` is [tokens of the pass, len(aux_layer_ids) * hidden], or None."""

    aux_layer_ids: list[int]
    aux_hidden: torch.Tensor | None


DEVICE_DRAFTS_FLAG = "ONECAT_DRAFTS_ON_DEVICE"
DRAFT_LENGTHS_FLAG = "ONECAT_DRAFT_LENGTHS"  # 0: a block drafter drafts its whole block every round (A/B)


def drafts_stay_on_device(target) -> bool:
    """Whether a drafter running on `target`'s device leaves its drafts there until verified: on a GPU, unless
    the engine is tensor parallel (its other ranks are sent host lists); ONECAT_DRAFTS_ON_DEVICE=0 reads them
    back each round instead (an A/B switch for measurements)."""
    if not switch(DEVICE_DRAFTS_FLAG, True):
        return False
    return target.device.type == "cuda" and not target.has_peer_ranks


def hidden_state_tap(model: torch.nn.Module) -> HiddenStateTap:
    """The target model as a tap; a ConfigError when its class keeps no per-layer hidden states."""
    if not isinstance(model, HiddenStateTap):
        raise ConfigError(f"{type(model).__name__} does not keep per-layer hidden states (aux_layer_ids / "
                          "aux_hidden), so a drafter conditioned on them cannot run on it; use ngram or draft_model")
    return model


class Proposer(ABC):
    """Proposes up to `k` next tokens per sequence."""

    name = "abstract"
    tap: HiddenStateTap | None = None  # set by drafters that read the target's hidden states
    # drafts returned as 1-D device tensors (a drafter that runs on the device: no read-back before the
    # verify step, whose input ids take them from the device); plain lists otherwise
    drafts_on_device = False
    # a block drafter whose later drafts are rarely accepted: each request drafts only the positions worth
    # verifying (draft_length.py)
    trims_drafts = False
    # proposes from the host's token lists alone, cheaply (prompt lookup): the decode pipeline may ask it while a
    # step is in flight, whether it would find anything, instead of draining to ask (SpeculativeDecoder.pipeline_paused)
    looks_up_on_host = False

    def __init__(self, k: int):
        self.k = k

    @property
    def wants_features(self) -> bool:
        """True when the drafter needs the target's hidden states of every computed position."""
        return self.tap is not None

    def record_features(self, seq: Sequence, rows: FeatureRows) -> None:
        """Keep the target's hidden states of the sequence's newly computed (accepted) positions."""
        raise NotImplementedError(f"the {self.name} proposer reads no target features (wants_features is False)")

    @abstractmethod
    def propose(self, seqs: list[Sequence], budgets: list[int]) -> list[Draft]:
        """One draft per sequence, at most its budget long: a list, or a 1-D device tensor where
        `drafts_on_device`. A sampled request's drafts are best drawn with the target's keys (keyed_draws.py)."""

    def observe(self, seq: Sequence, num_drafted: int, num_accepted: int) -> None:
        """Feedback after verification (adaptive proposers widen or narrow their k)."""

    def release(self, seq: Sequence) -> None:
        """The sequence finished: drop any per-sequence state."""

    drafts_ahead = False  # verify steps launch its next round before their tokens are read (draft_ahead.py)

    def draft_ahead(self, seqs: list[Sequence], spans: list[FeatureRows], accepted: torch.Tensor,
                    bonus: torch.Tensor) -> None:
        """Launch the next round for `seqs` from a verify step's device results (where `drafts_ahead`)."""
        raise NotImplementedError(f"the {self.name} proposer does not draft ahead")

    @property
    def graph_captures(self) -> int:
        """CUDA graphs the drafter has captured so far."""
        graphs = getattr(self, "graphs", None)
        return graphs.captures if graphs is not None else 0

    def defer_context(self, paused: bool) -> None:
        """Drafting is off for now (`paused`: the gate found it slower at this batch size), or back on: a proposer
        that builds a per-request context from every step may put that work off until it drafts again."""

    @property
    def one_off_work(self) -> int:
        """One-time pieces of work done so far (graph captures; a block drafter's projections of prompts): a step
        in which this grows timed that work, not what a round or a plain step costs."""
        return self.graph_captures

    def describe(self) -> dict:
        return {"method": self.name, "num_speculative_tokens": self.k}


class SpeculativeDecoder:
    """Drafts for the decoding sequences, verifies their drafts, counts acceptance. With a measuring gate
    (controller.py) it drafts only while a round moves more tokens per second than a plain step. Sampled
    requests are gated too: their tokens are keyed draws (verifier.py), the same whether a step drafted or
    not, so the gate's timing never changes a seeded request's output."""

    def __init__(self, proposer: Proposer, max_model_len: int, gate: SpeculationGate | None = None):
        self.proposer = proposer
        self.max_model_len = max_model_len
        self.k = proposer.k
        self.gate = gate if gate is not None else SpeculationGate(enabled=False)
        trim = proposer.trims_drafts and switch(DRAFT_LENGTHS_FLAG, True)
        self.lengths = DraftLengths(proposer.k) if trim else None
        self._one_off = proposer.one_off_work
        self._widest = 0  # the most drafts a sequence of the last lookahead verifies
        self.pipelined_lookups = 0  # empty proposals made while a pipelined step was in flight (pipeline_paused)

    @property
    def trims_drafts(self) -> bool:
        """Requests draft fewer than k tokens by their acceptance (draft_length.py): verify steps of narrower
        widths then replay graphs of their own (worker/cuda_graph.py)."""
        return self.lengths is not None

    def lookahead(self, running: list[Sequence]) -> dict[str, int]:
        """Draft for every running sequence that is decoding; returns the KV slots each needs."""
        for seq in running:
            seq.draft_tokens = []
        self.proposer.defer_context(self.gate.enabled and self.gate.pays(len(running)) is False)
        decoding = [s for s in running if s.num_tokens - s.num_computed_tokens == 1]
        # by the whole batch's verdict: a step where some still prefill is never timed, so the bucket of its
        # decoding sequences alone would never learn, and the batch decodes at its full size once they are in
        if decoding and not self.gate.wants_drafts(len(running)):
            return {}
        seqs, budgets = [], []
        for seq in decoding:
            if seq.params.prompt_logprobs is not None:
                continue
            if seq.params.logits_processors:  # verification does not run them: no drafts
                continue
            p = seq.params
            left = (p.max_tokens - seq.num_output_tokens) if p.max_tokens is not None else self.k + 1
            budget = min(self.k, left - 1, self.max_model_len - seq.num_tokens - 1)
            if budget > 0 and self.lengths is not None:
                budget = min(budget, self.lengths.length(seq.request_id, len(decoding)))
            if budget > 0:
                seqs.append(seq)
                budgets.append(budget)
        if not seqs:
            return {}
        result = {}
        for seq, draft in zip(seqs, self.proposer.propose(seqs, budgets)):
            if len(draft):
                seq.draft_tokens = draft
                result[seq.request_id] = len(draft)
        if decoding:
            self.gate.proposed(bool(result))
        self._widest = max(result.values(), default=0)
        return result

    def pipeline_paused(self, running: list[Sequence], in_flight: bool = False) -> bool:
        """True while the gate has drafting off for this batch and no probe is due: the engine may run these plain
        steps in its one-step-ahead decode pipeline. When the proposer's turn comes while a pipelined step is
        `in_flight` and the proposer looks up on the host (`looks_up_on_host`), it is asked here on the tokens the
        host has (that step's not among them): only a draft found drains the pipeline for a round (whose own lookup
        then sees every token); nothing found backs the proposer off as an empty proposal does, and the pipeline
        runs on. So text that never repeats costs lookups overlapped with the device, not a drained step each time.
        (A gate that is off drafts whenever its proposer finds a draft with every token: never asked here.)"""
        batch = len(running)
        if self.gate.paused(batch):
            return True
        if not (in_flight and self.gate.enabled and self.proposer.looks_up_on_host and running
                and self.gate.wants_drafts(batch)):
            return False
        if any(len(d) for d in self.proposer.propose(running, [self.k] * batch)):
            return False
        self.gate.proposed(False)
        self.pipelined_lookups += 1
        return True

    def step_done(self, batch: int, drafted: bool, seconds: float, tokens_per_seq: float) -> None:
        """A pure decode step of `batch` sequences took `seconds` of wall time (for the gate); a step in which the
        proposer did one-off work (captured a CUDA graph; projected a new request's prompt for its drafter, which
        a request's first decode step does, drafting or not) counts as a step but is no sample of what a round or
        a plain step costs."""
        one_off = self.proposer.one_off_work
        timed, self._one_off = one_off == self._one_off, one_off
        self.gate.record(batch, drafted, seconds if timed else None, tokens_per_seq)
        if timed and self.lengths is not None and self.lengths.costed:  # what a round of each length costs
            self.lengths.costs.record(batch, self._widest if drafted else 0, seconds)

    def verify(self, blocks: list[tuple[Sequence, ScheduledSeq, torch.Tensor]],
               spans: list[FeatureRows] | None = None) -> list[list[int]]:
        """The tokens one step's verify rows emit, per (sequence, its schedule, its verify logits
        [num_lookahead + 1, V]): all sequences verified at once on the device, read back in one go. With the
        sequences' tapped rows of the step (`spans`) a proposer that drafts ahead launches its next round
        before that read."""
        if not blocks:
            return []
        drafts = [seq.draft_tokens[:sched.num_lookahead] for seq, sched, _ in blocks]
        rows = verified_on_device([DraftBlock(draft, logits, seq.params, seq.seed, seq.num_tokens)
                                   for draft, (seq, _, logits) in zip(drafts, blocks)])
        if spans is not None and self.proposer.drafts_ahead:
            read = VerifiedRead(rows)  # before the drafter's kernels, which the read does not wait for
            accepted = rows[:, 0]
            self.proposer.draft_ahead([seq for seq, _, _ in blocks], spans, accepted,
                                      rows.gather(1, accepted.unsqueeze(1) + 1).squeeze(1))
            results = emitted_tokens(read.tolist())
        else:
            results = emitted_tokens(rows.tolist())
        for draft, (seq, _, _), tokens in zip(drafts, blocks, results):
            self._count(seq, len(draft), len(tokens) - 1)
        return results

    def _count(self, seq: Sequence, drafted: int, accepted: int) -> None:
        """Acceptance statistics of a verified block, and the proposer's feedback; the draft is spent."""
        s = seq.spec
        s.num_drafts += 1
        s.num_draft_tokens += drafted
        s.num_accepted_tokens += accepted
        if len(s.accepted_per_position) < self.k:
            s.accepted_per_position.extend([0] * (self.k - len(s.accepted_per_position)))
        for j in range(accepted):
            s.accepted_per_position[j] += 1
        self.proposer.observe(seq, drafted, accepted)
        if self.lengths is not None:
            self.lengths.observe(seq.request_id, drafted, accepted)
        seq.draft_tokens = []

    def release(self, seq: Sequence) -> None:
        self.proposer.release(seq)
        if self.lengths is not None:
            self.lengths.release(seq.request_id)

    def describe(self) -> dict:
        lengths = {"draft_lengths": self.lengths.describe()} if self.lengths is not None else {}
        return {**self.proposer.describe(), **lengths, "gate": self.gate.report(),
                "pipelined_lookups": self.pipelined_lookups}

    # ---- feature capture (block drafters) -------------------------------------------------------
    @property
    def wants_features(self) -> bool:
        return self.proposer.wants_features

    def step_features(self) -> torch.Tensor | None:
        """The tapped hidden states of the forward pass just run (one row per computed position), or None."""
        tap = self.proposer.tap
        return tap.aux_hidden if tap is not None else None

    def record_features(self, seq: Sequence, rows: FeatureRows) -> None:
        self.proposer.record_features(seq, rows)
