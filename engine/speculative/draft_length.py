"""How many drafts a request proposes: as many as its recent rounds say are worth verifying.

A block drafter proposes a whole block (DFlash: up to 15 drafts) and every draft is a row of the verify step,
whether or not the target could accept it. Per-position acceptance falls fast (the trained drafter's: 0.75,
0.47, 0.25, 0.12, 0.05, ...), and a row is not free: at batch 8 a verify step of 16 rows a request costs ~0.2
plain steps more than one of 8 on an 8B shape. Each request keeps, per draft position, decayed counts of the
rounds that offered it and of those that accepted through it; it drafts through the positions whose rate
(`(accepted + PRIOR) / (offered + 2 PRIOR)`: an unseen position counts as 1/2) stays at or above KEEP_RATE,
and one position more, which keeps being tried so that a rise in acceptance is seen. The counts decay by
DECAY a round (about the last ten rounds count), so a request whose text changes character is followed.
A position's rate also counts the finished requests' rounds (their counts pooled as they leave), weighted as up to
SEED_ROUNDS rounds and fading as the request's own offers of it come in: a new request starts where the last ones
ended instead of drafting whole blocks until its own rounds say otherwise: with a block of 15 and the prior of 1/2
that took five rounds of 16-row verify steps a request, and route 1's packed target runs a 16-row verify step in
its GEMV's two-operand form (~1.26 ms a round averaged on an H100, docs/speculative.md).
Verify steps then replay a narrower CUDA graph (worker/cuda_graph.py keeps widths 2, 4, 8, ..., 1 + k).
Which drafts are proposed never changes the tokens: the verifier is exact whatever the draft length.

With ONECAT_DRAFT_LENGTH_COSTS=1 (off by default: measured slower, at COSTED), once the engine has timed its
rounds (`RoundCosts`: seconds a round, per batch size bucket and per the step's widest draft count), a request
drafts the length that moves the most tokens a second by its rates and those costs: argmax over L of
(1 + r_1 + ... + r_L) / cost(L). A row's price is whatever the hardware makes it: on the 2-core AVX2 CPU a k = 7
step (~5 rows) took 27.0 ms of CPU time against 24.5 ms at k = 3 (4 rows) under the profiler, for a fourth
position accepted 2-6% of the time. A length not yet timed is priced
optimistically (no dearer than the widest timed one; a narrower one in proportion to its rows, or between its
timed neighbours and the plain step), so it is tried once and then priced by its own rounds; positions a request
stops offering drift back to the prior as their counts decay (slowly there: IDLE_DECAY), so a longer length is tried
again now and then (about every 140 rounds where a wider round costs 1.3x and its positions were never accepted).
"""
from __future__ import annotations

import statistics
from collections import deque

from onecat.engine.speculative.controller import batch_bucket
from onecat.engine.switches import switch

KEEP_RATE = 0.1  # a position whose drafts are accepted less often than this is not worth its verify row
PRIOR = 0.5  # pseudo-rounds of an unseen position (a rate of 1/2): the first request drafts the whole block
DECAY = 0.9  # weight of a round's counts one round later
# ... of a position's counts one round in which it was not offered, once lengths are chosen by cost: without the
# rate-only rule's one more position, counts decaying at DECAY would bring a dear length back every few rounds
IDLE_DECAY = 0.98
SEED_ROUNDS = 5.0  # the pooled rate of a position weighs as this many rounds until the request has offered it as often
SAMPLES, MIN_SAMPLES, MAX_AGE = 9, 3, 256  # a length's price: the median of its last 9 timings (3 at least, of the
# last 256 steps)
POOL = switch("ONECAT_DRAFT_LENGTH_POOL", True)  # 0: every request starts from the prior alone (A/B); read once
# lengths priced by the timed rounds: 1 on; 0 (default) the rate-only rule. Measured slower wherever tried: the
# DFlash gate on the 2-core AVX2 EPYC 1.377x against the rate-only rule's 1.426-1.543x (one run against two;
# acceptance 2.14 against 2.20 at batch 1: noisy timings on a shared CPU priced useful positions out), an H100's 8B
# DFlash-shaped rounds 0.96x at batch 1 and 0.82-0.92x at batch 8 (docs/speculative.md); kept for the A/B; read once
COSTED = switch("ONECAT_DRAFT_LENGTH_COSTS", False)


class RoundCosts:
    """Seconds a decode step takes, per batch size bucket (as the gate's: 1, 2, 3-4, 5-8, ...) and per the step's
    widest draft count (0: a plain step): the median of a length's last SAMPLES timings, counted once it has
    MIN_SAMPLES of them no older than MAX_AGE steps. A median, since one round in a request's life is far dearer
    than the rest (its first, which projects the whole prompt's features for the drafter); an age limit, since a
    length whose price is never re-taken would keep it forever (it is then priced as untimed, and tried again)."""

    def __init__(self):
        self._samples: dict[int, dict[int, deque]] = {}  # bucket -> drafts -> (step, seconds)
        self._steps = 0

    def record(self, batch: int, drafts: int, seconds: float) -> None:
        """A timed decode step of `batch` sequences whose widest verified `drafts` drafts (0: a plain step)."""
        self._steps += 1
        table = self._samples.setdefault(batch_bucket(batch), {})
        table.setdefault(drafts, deque(maxlen=SAMPLES)).append((self._steps, seconds))

    def _timed(self, batch: int) -> dict[int, float]:
        fresh = {}
        for drafts, samples in self._samples.get(batch_bucket(batch), {}).items():
            recent = [t for step, t in samples if self._steps - step <= MAX_AGE]
            if len(recent) >= MIN_SAMPLES:
                fresh[drafts] = statistics.median(recent)
        return fresh

    def known(self, batch: int) -> bool:
        """Whether rounds with drafts are timed at this batch size."""
        return any(self._timed(batch))

    def any_known(self) -> bool:
        return any(any(table) for table in self._samples.values())

    def estimates(self, batch: int, widest: int) -> list[float] | None:
        """A round's seconds at 1..widest drafts: as timed, else between the timed neighbours (the plain step counts
        as 0 drafts), else optimistic: a wider round as dear as the widest timed, a narrower one in proportion to
        its rows; never below a narrower length's (a timing that came out low on a busy machine does not make a
        wider round look cheaper than a narrower one). None until a round with drafts is timed (`known`)."""
        points = self._timed(batch)
        if not any(points):
            return None
        out = []
        for drafts in range(1, widest + 1):
            lower = [n for n in points if n <= drafts]
            upper = [n for n in points if n > drafts]
            if lower and (not upper or max(lower) == drafts):
                lo = max(lower)
                out.append(points[lo])  # timed, or wider than every timed length
            elif lower:
                lo, hi = max(lower), min(upper)
                out.append(points[lo] + (points[hi] - points[lo]) * (drafts - lo) / (hi - lo))
            else:
                hi = min(upper)
                out.append(points[hi] * (drafts + 1) / (hi + 1))
            if len(out) > 1:
                out[-1] = max(out[-1], out[-2])
        return out

    def describe(self) -> dict:
        return {str(b): {str(n): round(1e3 * statistics.median(t for _, t in samples), 3)
                         for n, samples in sorted(table.items())}
                for b, table in sorted(self._samples.items())}


class DraftLengths:
    def __init__(self, k: int, costed: bool | None = None):
        """`costed`: lengths by the timed rounds once there are any (None: ONECAT_DRAFT_LENGTH_COSTS)."""
        self.k, self.costed = k, COSTED if costed is None else costed
        self.costs = RoundCosts()
        self._offered: dict[str, list[float]] = {}
        self._accepted: dict[str, list[float]] = {}
        self._pool = ([0.0] * k, [0.0] * k)  # finished requests' counts (offered, accepted), each half the one before
        self.proposed = 0  # drafts verified, and the blocks' worth of them (for describe()): a round in which the
        self.full = 0  # proposer had nothing to offer asks for none

    def length(self, request_id: str, batch: int | None = None) -> int:
        """Drafts worth proposing for the request's next round (1..k): by the timed rounds' costs at this batch size
        where there are any, else through the positions accepted at least KEEP_RATE of the time, and one more."""
        rates = self.rates(request_id)
        prices = self.costs.estimates(batch, self.k) if batch is not None and self.costed else None
        if prices is not None:
            tokens, best, best_rate = 1.0, 1, 0.0
            for n, (rate, seconds) in enumerate(zip(rates, prices), start=1):
                tokens += rate
                if tokens / seconds > best_rate:
                    best, best_rate = n, tokens / seconds
            return best
        for j, rate in enumerate(rates):
            if rate < KEEP_RATE:
                return j + 1
        return self.k

    def rates(self, request_id: str) -> list[float]:
        """Per draft position, how often the request's recent rounds accepted through it (an unseen position: 1/2;
        a new request's: the finished requests' pooled rate, fading as its own offers come in)."""
        offered, accepted = self._offered.get(request_id), self._accepted.get(request_id)
        pool_offered, pool_accepted = self._pool
        rates = []
        for j in range(self.k):
            own_o, own_a = (offered[j], accepted[j]) if offered is not None else (0.0, 0.0)
            # the pool's rate, weighted as up to SEED_ROUNDS rounds, fading as the request's own offers come in
            w = SEED_ROUNDS * min(1.0, pool_offered[j]) * max(0.0, 1.0 - own_o / SEED_ROUNDS)
            pooled = w * pool_accepted[j] / pool_offered[j] if w else 0.0
            rates.append((own_a + PRIOR + pooled) / (own_o + 2 * PRIOR + w))
        return rates

    def observe(self, request_id: str, drafted: int, accepted: int) -> None:
        """A verified round: `drafted` positions offered, the first `accepted` of them accepted."""
        self.proposed += drafted
        self.full += self.k
        offered = self._offered.setdefault(request_id, [0.0] * self.k)
        taken = self._accepted.setdefault(request_id, [0.0] * self.k)
        idle = IDLE_DECAY if self.costed and self.costs.any_known() else DECAY
        for j in range(self.k):
            decay = DECAY if j < drafted else idle
            offered[j] = decay * offered[j] + (j < drafted)
            taken[j] = decay * taken[j] + (j < accepted)

    def release(self, request_id: str) -> None:
        """The request is done: its counts join the pool (each finished request weighs half of what came before)."""
        offered, taken = self._offered.pop(request_id, None), self._accepted.pop(request_id, None)
        if offered is not None and POOL:
            for pooled, own in zip(self._pool, (offered, taken)):
                pooled[:] = [(p + o) / 2 for p, o in zip(pooled, own)]

    def describe(self) -> dict:
        start = "starting where the finished requests ended" if POOL else "starting from the prior alone"
        rule = f"positions accepted >= {KEEP_RATE:g} of the recent rounds, and one more"
        policy = (f"the length that moves the most tokens a second by its positions' recent acceptance and the timed "
                  f"rounds' cost at each length (before any round is timed: {rule})" if self.costed else rule)
        return {"policy": f"per request: {policy}; {start}",
                "drafts_asked_per_block": round(self.proposed / self.full, 3) if self.full else None,
                "round_ms_by_batch_and_drafts": self.costs.describe()}
