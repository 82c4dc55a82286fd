"""Continuous batching with chunked prefill under a token budget, and preemption by recompute.

Each step: running sequences first (decodes and unfinished prefills, oldest first), then waiting
sequences while the token budget, the sequence limit and free KV blocks allow. When a running
sequence cannot get a block, the newest running sequence is preempted: its blocks are freed and it
goes back to the front of the queue to be recomputed later (prefix caching makes that cheap).
With `admission_wave` W > 1, waiting sequences start while others decode only once W of them (or all
that wait, if fewer) have free slots; the wave then goes on over the next steps, as the token budget
allows, until the slots are full or nothing waits. A step with prefill rows runs eagerly where a pure
decode step replays a CUDA graph, and a long offline job whose requests end one by one would otherwise
mix a new prompt into nearly every step.
"""
from __future__ import annotations

import time
from collections import deque

from onecat.engine.config import EngineConfig
from onecat.engine.core.block_manager import BlockManager
from onecat.engine.core.scheduler_output import ScheduledSeq, SchedulerOutput
from onecat.engine.core.sequence import Sequence, SequenceStatus


class Scheduler:
    def __init__(self, cfg: EngineConfig, blocks: BlockManager):
        self.cfg = cfg
        self.blocks = blocks
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self._wave_open = False  # admission_wave: a wave of waiting sequences is being admitted

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.blocks.free_seq(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        out.preempted.append(seq)

    def schedule(self, lookahead: dict[str, int] | None = None) -> SchedulerOutput:
        """`lookahead` maps request ids to extra KV slots wanted this step (speculative drafts)."""
        out = SchedulerOutput()
        budget = self.cfg.max_num_batched_tokens
        lookahead = lookahead or {}
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            remaining = seq.num_tokens - seq.num_computed_tokens
            extra = lookahead.get(seq.request_id, 0) if remaining == 1 else 0
            n = self.blocks.aligned_chunk(seq.num_computed_tokens, min(remaining + extra, budget))
            extra = max(0, n - remaining)
            while not self.blocks.ensure_capacity(seq, seq.num_computed_tokens + n):
                victim = self.running.pop()
                self._preempt(victim, out)
                if victim is seq:
                    break
            else:
                out.scheduled.append(ScheduledSeq(seq, n - extra, extra))
                budget -= n
                i += 1
        while self.waiting and budget > 0 and len(self.running) < self.cfg.max_num_seqs and self._may_admit():
            seq = self.waiting[0]
            if seq.num_computed_tokens == 0 and not seq.block_table:
                self.blocks.match_prefix(seq)
            n = self.blocks.aligned_chunk(seq.num_computed_tokens, min(seq.num_tokens - seq.num_computed_tokens, budget))
            if not self.blocks.ensure_capacity(seq, seq.num_computed_tokens + n):
                if not self.running:  # nothing will ever free memory: should be impossible (checked on add)
                    raise RuntimeError("KV cache too small for a single request")
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.perf_counter()
            self.running.append(seq)
            out.scheduled.append(ScheduledSeq(seq, n))
            budget -= n
        if not self.waiting or len(self.running) >= self.cfg.max_num_seqs:
            self._wave_open = False
        return out

    def _may_admit(self) -> bool:
        self._wave_open = self.admits_waiting()
        return self._wave_open

    def admits_waiting(self) -> bool:
        """Whether the next step would start a waiting sequence (the one-step-ahead decode pipeline drains for
        it): with a free slot, when nothing runs, a wave is open, or a wave's slots are free."""
        if not self.waiting or len(self.running) >= self.cfg.max_num_seqs:
            return False
        wave = min(self.cfg.admission_wave, len(self.waiting))
        return self._wave_open or not self.running or self.cfg.max_num_seqs - len(self.running) >= wave

    def reserve_decode(self, seq: Sequence, num_tokens: int) -> bool:
        """Give a running sequence KV room for `num_tokens` tokens outside `schedule()` (the one-step-ahead
        decode pipeline launches before the host has scheduled); False, with nothing taken, when memory is
        short: the caller then leaves the step to `schedule()`, which can preempt."""
        return self.blocks.ensure_capacity(seq, num_tokens)

    def finish(self, seq: Sequence, reason: str, stop_reason=None) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        seq.finish_time = time.perf_counter()
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free_seq(seq)
