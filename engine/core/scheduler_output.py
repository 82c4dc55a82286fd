"""What the scheduler hands the rest of a step: the sequences to run and how many tokens of each.

Its own module so that the worker (which runs a step) and the speculative proposer (which verifies
one) read a step's plan without depending on the scheduler itself."""
from __future__ import annotations

from dataclasses import dataclass, field

from onecat.engine.core.sequence import Sequence


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # tokens whose KV this step computes (from seq.num_computed_tokens on)
    num_lookahead: int = 0  # speculative draft tokens appended for verification (not yet accepted)


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)
