"""When drafting pays: the engine times its own decode steps with and without drafts and drafts only while
a speculative round moves more tokens per second than a plain step.

A round costs more than a plain step (the drafter's work, 1 + k rows to verify) and moves 1 + accepted tokens per
sequence; a plain step moves one. Both are measured here, per batch size up to the next power of two (pure decode
steps only: a step that also prefills is not comparable), as moving averages of wall time per step (the step ends
with the host reading its tokens, so wall time covers the device's work and the host's). Drafting stays on while
`tokens per round / round time >= 1 / plain step time`. A mode that is off is probed now and then (one step every
`probe_every`; a probe moves its mode's averages by PROBE_WEIGHT) so that a change in acceptance or in cost is
noticed. Probes of a verdict that holds are spaced out: while drafting wins, x2 a confirming probe up to
`MAX_PROBE_EVERY` steps; while it loses, probed twice within 3 x base steps (so an early unlucky estimate cannot
lock drafting out for long), then spaced at once as far as its probes cost at most PROBE_COST of the decode time,
and at most MAX_LOSING_PROBE_EVERY steps (a probe round loses `round - tokens x plain step` against plain steps: a
round near break-even is probed often, one that loses badly rarely). Doubling the whole way there cost more:
on the embedded target on an H100 at batch 8 a probe round costs ~14 plain steps, and the probes at 128, 256 and
512 steps apart took ~6% of the decode time. Once the verdict changes, probing starts again at the base rate.
Either way the request gets the target's exact distribution: the verifier is exact, plain steps sample from the
target.

A batch size measured for the first time starts from the verdict of the largest smaller batch size measured so
far when that verdict is a loss (its averages, probed at the base rate): a verify step of more sequences is more
compute-bound, so drafting that loses at batch 1 loses at 8 too, and without this each new bucket paid WARMUP + 1
rounds before it could judge (on the embedded target on an H100 a round costs ~8 plain steps). A winning verdict is
not carried over: each larger batch size measures its own.

Separately, a proposer that keeps finding nothing to draft (prompt lookup over text that never repeats) is
asked less often: after each empty proposal the next `skip` steps do not call it (doubling, up to
`probe_every`), so its cost fades where it has nothing to offer.

While drafting is off for a batch (`paused`), its plain steps may run in the one-step-ahead decode
pipeline as target-only decoding does (engine/core/decode_pipeline.py); the pipeline drains when a probe
is due, or when a prompt-lookup proposer asked in flight finds a draft (SpeculativeDecoder.pipeline_paused).
Steps are counted where they are recorded, so both paths advance the same counters.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

WARMUP = 2  # first samples of a (mode, batch size) not averaged: graph capture and first-call costs
ALPHA = 0.1  # weight of the newest sample in the moving averages
PROBE_WEIGHT = 0.5  # a probe is the only fresh sample of its mode: it moves that mode's averages further
MAX_PROBE_EVERY = 256
PROBE_COST = 0.01  # while drafting loses: the share of decode time its probes may cost
MAX_LOSING_PROBE_EVERY = 1024  # ... and yet a rise in acceptance is noticed within this many steps


def batch_bucket(batch: int) -> int:
    """The bucket a batch size is measured in: the next power of two (1, 2, 3-4, 5-8, ...)."""
    return 1 << max(0, batch - 1).bit_length()


@dataclass(slots=True)
class _Mean:
    seen: int = 0
    value: float | None = None

    def add(self, x: float, weight: float = ALPHA) -> None:
        self.seen += 1
        if self.seen > WARMUP:
            self.value = x if self.value is None else (1 - weight) * self.value + weight * x


@dataclass(slots=True)
class _Bucket:
    plain_s: _Mean = field(default_factory=_Mean)  # seconds per plain decode step
    round_s: _Mean = field(default_factory=_Mean)  # seconds per speculative round
    tokens: _Mean = field(default_factory=_Mean)  # tokens per sequence per round (1 + accepted)
    since_probe: int = 0
    probe_every: int = 0  # steps between probes now: doubles while probes confirm the verdict


class SpeculationGate:
    def __init__(self, enabled: bool = True, probe_every: int = 32):
        self.enabled, self.probe_every = enabled, probe_every
        self._buckets: dict[int, _Bucket] = {}
        self._skip = 0  # steps left without calling the proposer
        self._empty_backoff = 1
        self._asked = False  # the proposer was asked this step and found nothing
        self.steps = {"drafted": 0, "plain_by_choice": 0, "plain_probes": 0, "draft_probes": 0,
                      "proposer_skipped": 0, "untimed": 0}

    def _bucket(self, batch: int) -> _Bucket:
        """Batch sizes share a bucket up to the next power of two (1, 2, 3-4, 5-8, ...): a batch that
        shrinks as its requests finish is not measured afresh at every size."""
        key = batch_bucket(batch)
        b = self._buckets.get(key)  # (asked a few times every decode step: no bucket is built to be dropped)
        if b is None:
            b = self._buckets[key] = self._losing_below(key) or _Bucket(probe_every=self.probe_every)
        return b

    def _losing_below(self, key: int) -> _Bucket | None:
        """A new bucket seeded with the averages of the largest smaller bucket measured so far, where that one's
        verdict is a loss; None otherwise."""
        smaller = [k for k, b in self._buckets.items() if k < key and self._verdict(b) is not None]
        if not smaller:
            return None
        below = self._buckets[max(smaller)]
        if self._verdict(below) is not False:
            return None
        seen = WARMUP + 1  # counted as measured: the verdict holds until this bucket's own probes move it
        return _Bucket(*(_Mean(seen, m.value) for m in (below.plain_s, below.round_s, below.tokens)),
                       probe_every=self.probe_every)

    def pays(self, batch: int) -> bool | None:
        """True / False once both modes are measured at this batch size; None before."""
        return self._verdict(self._bucket(batch))

    @staticmethod
    def _verdict(b: _Bucket) -> bool | None:
        if b.plain_s.value is None or b.round_s.value is None or b.tokens.value is None:
            return None
        return b.tokens.value / b.round_s.value >= 1.0 / b.plain_s.value

    def wants_drafts(self, batch: int) -> bool:
        """Whether this decode step of `batch` sequences should draft."""
        if not self.enabled:
            return True
        if self._skip > 0:
            return False
        b = self._bucket(batch)
        verdict = self._verdict(b)
        if verdict is None:  # measure rounds first, then plain steps
            return b.round_s.value is None or b.tokens.value is None or b.plain_s.value is not None
        if b.since_probe >= b.probe_every:  # now and then the other mode, to notice a change
            return not verdict
        return verdict

    def paused(self, batch: int) -> bool:
        """True while this batch's next step will not draft (drafting loses, or the proposer is backed
        off) and no probe is due: the step may run as a plain pipelined decode. Changes nothing."""
        if not self.enabled:
            return False
        if self._skip > 0:
            return True
        b = self._bucket(batch)
        return self._verdict(b) is False and b.since_probe + 1 < b.probe_every

    def proposed(self, found_any: bool) -> None:
        """After a proposer call: back off while it finds nothing to draft."""
        if found_any:
            self._empty_backoff, self._skip = 1, 0
            return
        if self.enabled:
            self._skip, self._asked = self._empty_backoff, True  # skipping starts with the next step
            self._empty_backoff = min(2 * self._empty_backoff, self.probe_every)

    def record(self, batch: int, drafted: bool, seconds: float | None, tokens_per_seq: float) -> None:
        """One pure decode step's wall time; `drafted` when it verified drafts. `seconds` None: a step that is
        counted (probe spacing) but not timed (it captured a graph: a one-time cost, not the mode's)."""
        b = self._bucket(batch)
        verdict = self._verdict(b)
        probed = False
        if self._asked:
            self._asked = False
            b.since_probe += 1
        elif self._skip > 0 and not drafted:
            self._skip -= 1
            self.steps["proposer_skipped"] += 1
        elif verdict is not None and drafted != verdict:  # a probe of the mode that is off
            b.since_probe = 0
            self.steps["plain_probes" if verdict else "draft_probes"] += 1
            probed = True
        else:
            b.since_probe += 1
            if verdict is False:
                self.steps["plain_by_choice"] += 1
        weight = PROBE_WEIGHT if probed else ALPHA
        if drafted:
            self.steps["drafted"] += 1
        if seconds is None:
            self.steps["untimed"] += 1
        elif drafted:
            b.round_s.add(seconds, weight)
            b.tokens.add(tokens_per_seq, weight)
        else:
            b.plain_s.add(seconds, weight)
        # probes of a verdict that holds are spaced out as long as they confirm it (a losing one only as far
        # as its probes stay cheap); a changed or unknown verdict is probed at the base rate again
        now = self._verdict(b)
        if verdict is not None and now is verdict:
            cap = MAX_PROBE_EVERY if verdict else self._losing_spacing(b)
            if probed and not verdict and b.probe_every > self.probe_every:
                b.probe_every = cap  # a loss confirmed twice: straight to the spacing its probe budget allows
            else:
                b.probe_every = min(2 * b.probe_every if probed else b.probe_every, cap)
        else:
            b.probe_every = self.probe_every

    def _losing_spacing(self, b: _Bucket) -> int:
        """Steps between draft probes at which they cost PROBE_COST of the decode time: a probe round loses
        `round - tokens x plain` seconds against the plain steps that move its tokens."""
        lost = b.round_s.value - b.tokens.value * b.plain_s.value
        return max(self.probe_every, min(MAX_LOSING_PROBE_EVERY, math.ceil(lost / (PROBE_COST * b.plain_s.value))))

    def report(self) -> dict:
        per_batch = {}
        for batch, b in sorted(self._buckets.items()):
            if b.plain_s.value is None and b.round_s.value is None:
                continue
            per_batch[batch] = {
                "plain_step_ms": None if b.plain_s.value is None else round(1e3 * b.plain_s.value, 4),
                "round_ms": None if b.round_s.value is None else round(1e3 * b.round_s.value, 4),
                "tokens_per_round": None if b.tokens.value is None else round(b.tokens.value, 3),
                "drafting_pays": self.pays(batch), "probe_every": b.probe_every}
        return {"measured": self.enabled, "probe_every": self.probe_every, "steps": dict(self.steps),
                "per_batch_size_up_to": per_batch}
