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
"""
from __future__ import annotations

from onecat.engine.switches import switch

KEEP_RATE = 0.1  # a position whose drafts are accepted less often than this is not worth its verify row
PRIOR = 0.5  # pseudo-rounds of an unseen position (a rate of 1/2): the first request drafts the whole block
DECAY = 0.9  # weight of a round's counts one round later
SEED_ROUNDS = 5.0  # the pooled rate of a position weighs as this many rounds until the request has offered it as often
POOL = switch("ONECAT_DRAFT_LENGTH_POOL", True)  # 0: every request starts from the prior alone (A/B); read once


class DraftLengths:
    def __init__(self, k: int):
        self.k = k
        self._offered: dict[str, list[float]] = {}
        self._accepted: dict[str, list[float]] = {}
        self._pool = ([0.0] * k, [0.0] * k)  # finished requests' counts (offered, accepted), each half the one before
        self.proposed = 0  # drafts verified, and the blocks' worth of them (for describe()): a round in which the
        self.full = 0  # proposer had nothing to offer asks for none

    def length(self, request_id: str) -> int:
        """Drafts worth proposing for the request's next round (1..k)."""
        offered, accepted = self._offered.get(request_id), self._accepted.get(request_id)
        pool_offered, pool_accepted = self._pool
        for j in range(self.k):
            own_o, own_a = (offered[j], accepted[j]) if offered is not None else (0.0, 0.0)
            # the pool's rate, weighted as up to SEED_ROUNDS rounds, fading as the request's own offers come in
            w = SEED_ROUNDS * min(1.0, pool_offered[j]) * max(0.0, 1.0 - own_o / SEED_ROUNDS)
            pooled = w * pool_accepted[j] / pool_offered[j] if w else 0.0
            if (own_a + PRIOR + pooled) / (own_o + 2 * PRIOR + w) < KEEP_RATE:
                return j + 1
        return self.k

    def observe(self, request_id: str, drafted: int, accepted: int) -> None:
        """A verified round: `drafted` positions offered, the first `accepted` of them accepted."""
        self.proposed += drafted
        self.full += self.k
        offered = self._offered.setdefault(request_id, [0.0] * self.k)
        taken = self._accepted.setdefault(request_id, [0.0] * self.k)
        for j in range(self.k):
            offered[j] = DECAY * offered[j] + (j < drafted)
            taken[j] = DECAY * taken[j] + (j < accepted)

    def release(self, request_id: str) -> None:
        """The request is done: its counts join the pool (each finished request weighs half of what came before)."""
        offered, taken = self._offered.pop(request_id, None), self._accepted.pop(request_id, None)
        if offered is not None and POOL:
            for pooled, own in zip(self._pool, (offered, taken)):
                pooled[:] = [(p + o) / 2 for p, o in zip(pooled, own)]

    def describe(self) -> dict:
        start = "starting where the finished requests ended" if POOL else "starting from the prior alone"
        return {"policy": f"per request: positions accepted >= {KEEP_RATE:g} of the recent rounds, and one more; "
                          f"{start}",
                "drafts_asked_per_block": round(self.proposed / self.full, 3) if self.full else None}
