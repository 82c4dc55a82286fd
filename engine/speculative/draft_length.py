"""How many drafts a request proposes: as many as its recent rounds say are worth verifying.

A block drafter proposes a whole block (DFlash: up to 15 drafts) and every draft is a row of the verify step,
whether or not the target could accept it. Per-position acceptance falls fast (the trained drafter's: 0.75,
0.47, 0.25, 0.12, 0.05, ...), and a row is not free: at batch 8 a verify step of 16 rows a request costs ~0.2
plain steps more than one of 8 on an 8B shape. Each request keeps, per draft position, decayed counts of the
rounds that offered it and of those that accepted through it; it drafts through the positions whose rate
(`(accepted + PRIOR) / (offered + 2 PRIOR)`: an unseen position counts as 1/2) stays at or above KEEP_RATE,
and one position more, which keeps being tried so that a rise in acceptance is seen. The counts decay by
DECAY a round (about the last ten rounds count), so a request whose text changes character is followed.
Verify steps then replay a narrower CUDA graph (worker/cuda_graph.py keeps widths 2, 4, 8, ..., 1 + k).
Which drafts are proposed never changes the tokens: the verifier is exact whatever the draft length.
"""
from __future__ import annotations

KEEP_RATE = 0.1  # a position whose drafts are accepted less often than this is not worth its verify row
PRIOR = 0.5  # pseudo-rounds of an unseen position (a rate of 1/2): new requests draft the whole block
DECAY = 0.9  # weight of a round's counts one round later


class DraftLengths:
    def __init__(self, k: int):
        self.k = k
        self._offered: dict[str, list[float]] = {}
        self._accepted: dict[str, list[float]] = {}
        self.proposed = 0  # drafts verified, and the blocks' worth of them (for describe()): a round in which the
        self.full = 0  # proposer had nothing to offer asks for none

    def length(self, request_id: str) -> int:
        """Drafts worth proposing for the request's next round (1..k)."""
        offered, accepted = self._offered.get(request_id), self._accepted.get(request_id)
        n = self.k
        if offered is not None:
            n = next((j + 1 for j in range(self.k)
                      if (accepted[j] + PRIOR) / (offered[j] + 2 * PRIOR) < KEEP_RATE), self.k)
        return n

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
        self._offered.pop(request_id, None)
        self._accepted.pop(request_id, None)

    def describe(self) -> dict:
        return {"policy": f"per request: positions accepted >= {KEEP_RATE:g} of the recent rounds, and one more",
                "drafts_asked_per_block": round(self.proposed / self.full, 3) if self.full else None}
