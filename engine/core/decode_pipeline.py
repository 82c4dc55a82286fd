"""One-step-ahead decoding: launch step N+1 on the GPU before the host has read step N's tokens.

In a plain step loop the GPU idles while the host reads the sampled tokens, updates sequences,
schedules and prepares the next launch. For a steady batch of decodes on CUDA graphs that host work
does not depend on the token values, only the input ids do, and those can stay on the device: step N's
token (an argmax, or a draw keyed by the request's seed and the token's position, core/keyed_draws.py,
which needs no host value of step N) is copied into step N+1's graph inputs by the GPU itself. So each engine
step launches the next decode, then reads and applies the previous one while the GPU computes.

It runs only when the batch is steady: CUDA graphs on, no waiting request to admit now (none waits, the slots are
full, or an admission wave has not opened: core/scheduler.py), no speculative proposer or
one whose gate has paused drafting for this batch size (its plain steps then decode as target-only's do; a block
drafter's tapped features are recorded from the graph's output as in a plain step; a prompt-lookup proposer whose
turn comes is asked while the step is in flight, and only a draft found drains the pipeline), no request with logits
processors, logprobs or kept distributions. Anything else drains it (the step in flight is applied, nothing new
launched) and the normal scheduler takes over. A request that stops at step N has had step N+1 computed for it; that
result is dropped and its KV slot goes back with the request's blocks. Tokens are drawn from the same logits with
the same keys as in the plain loop, and applied by the same post-processing (EngineCore.postprocess), so outputs are
identical. KV room for the step ahead comes from the scheduler (`reserve_decode`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from onecat.engine.core.interfaces import SpeculativeProposer, StepWorker
from onecat.engine.core.keyed_draws import row_keys
from onecat.engine.core.sampler import sample_on_device
from onecat.engine.core.sampler_graphs import SAMPLER_GRAPHS, SamplerGraphs
from onecat.engine.core.scheduler import Scheduler
from onecat.engine.core.sequence import FeatureRows, Sequence, SequenceUpdate


class SteppingCore(Protocol):
    """What the pipeline needs of the engine core (EngineCore is one): its scheduler, worker and
    proposer, the length limit, and the one post-processing step that applies sampled tokens."""

    scheduler: Scheduler
    worker: StepWorker
    proposer: SpeculativeProposer | None
    max_model_len: int

    def postprocess(self, updates: list[SequenceUpdate]) -> list[Sequence]: ...


@dataclass
class _InFlight:
    seqs: list[Sequence]
    positions: list[int]  # the KV position each row computes; its output token is position + 1
    tokens: torch.Tensor  # [B] int64 on the device: each row's token
    host_tokens: torch.Tensor  # pinned copy, valid once `ready` has completed
    ready: torch.cuda.Event
    features: torch.Tensor | None = None  # a block drafter's tapped hidden states of the rows


class DecodePipeline:
    def __init__(self, core: SteppingCore):
        self.core = core
        self.inflight: _InFlight | None = None
        self.launches = 0
        self.sampler_graphs = SamplerGraphs()  # a sampled batch's draws, replayed (sampler_graphs.py)
        self.applied_batch = 0  # sequences of the step applied last

    # ---- when it may run --------------------------------------------------------------------------
    def _steady(self, in_flight: bool = False) -> bool:
        """Whether the next step may launch ahead; `in_flight`: a launched step is not yet applied (a host-side
        proposer is then asked here, overlapped with it, instead of draining the pipeline to ask)."""
        c = self.core
        graphs = c.worker.graphs
        if graphs is None or graphs.disabled_reason is not None:
            return False
        if c.proposer is not None and not c.proposer.pipeline_paused(c.scheduler.running, in_flight):
            return False
        if c.worker.has_peer_ranks:  # tensor parallel: every replay is described to the other ranks first
            return False
        if c.scheduler.admits_waiting() or not c.scheduler.running or len(c.scheduler.running) > graphs.sizes[-1]:
            return False
        for seq in c.scheduler.running:
            p = seq.params
            if p.logprobs is not None or p.logits_processors or p.keep_probs:
                return False
        return True

    def _will_finish_by_length(self, seq: Sequence, pending: int) -> bool:
        """True when the sequence certainly stops once `pending` unread tokens are applied."""
        p = seq.params.max_tokens
        return (p is not None and seq.num_output_tokens + pending >= p) or \
            seq.num_tokens + pending >= self.core.max_model_len

    # ---- one engine step --------------------------------------------------------------------------
    def step(self) -> list[Sequence] | None:
        """The sequences touched by the step applied now, or None when the pipeline does not apply."""
        if self.inflight is None:
            if not self._steady():
                return None
            running = list(self.core.scheduler.running)
            if any(seq.num_computed_tokens + 1 != seq.num_tokens for seq in running):
                return None  # a prefill is unfinished: the scheduler's job
            self.inflight = self._launch(running, [seq.num_computed_tokens for seq in running], None)
            if self.inflight is None:
                return None
        cur, self.inflight = self.inflight, None
        running = self.core.scheduler.running
        if len(running) == len(cur.seqs) and all(a is b for a, b in zip(running, cur.seqs)) and self._steady(True):
            if not all(self._will_finish_by_length(seq, 1) for seq in cur.seqs):
                self.inflight = self._launch(cur.seqs, [p + 1 for p in cur.positions], cur.tokens)
        return self._apply(cur)

    def _launch(self, seqs: list[Sequence], positions: list[int], ids_dev: torch.Tensor | None):
        c = self.core
        for seq, p in zip(seqs, positions):
            if p + 1 >= c.max_model_len or not c.scheduler.reserve_decode(seq, p + 1):
                return None  # out of room: let the scheduler decide (preemption, length stop)
        graphs = c.worker.graphs
        size = next(s for s in graphs.sizes if s >= len(seqs))
        logits = graphs.replay(list(zip(seqs, positions)), size, ids_dev)
        if logits is None:
            return None
        params = [seq.params for seq in seqs]
        if all(p.greedy for p in params):
            tokens = c.worker.greedy_tokens(logits)
        else:  # the token at position p + 1, keyed as the plain step keys it (its num_tokens then)
            keys = row_keys([seq.seed for seq in seqs], [p + 1 for p in positions], logits.device)
            sample = self.sampler_graphs.sample if SAMPLER_GRAPHS else sample_on_device
            tokens = sample(logits[:len(seqs)], params, keys)
        features = c.proposer.step_features() if c.proposer is not None and c.proposer.wants_features else None
        host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        host.copy_(tokens, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        self.launches += 1
        return _InFlight(list(seqs), list(positions), tokens, host, ready, features)

    def _apply(self, cur: _InFlight) -> list[Sequence]:
        """Read a launched step's tokens and apply them with the plain step's post-processing."""
        cur.ready.synchronize()
        self.applied_batch = len(cur.seqs)
        rows = enumerate(zip(cur.seqs, cur.positions, cur.host_tokens.tolist()))
        feats = cur.features
        # a row whose request stopped or was aborted at an earlier step is dropped
        updates = [SequenceUpdate(seq, 1, [tok], None if feats is None else FeatureRows(feats, i, 1))
                   for i, (seq, p, tok) in rows if not seq.is_finished and seq.num_computed_tokens == p]
        return self.core.postprocess(updates)
