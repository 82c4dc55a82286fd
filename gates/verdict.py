"""The verdict from gate results: PROMOTE only on complete evidence that every gate passed.

    ROLLBACK      some non-informative gate FAILED (the candidate is measurably worse)
    INCONCLUSIVE  no failure, but some gate could not decide (or a workload did not finish)
    PROMOTE       every non-informative gate passed
Exit codes follow (cli/main.py): PROMOTE 0, ROLLBACK 1, INCONCLUSIVE 3.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from onecat.gates.checks.base import FAIL, INCONCLUSIVE

PROMOTE, ROLLBACK, VERDICT_INCONCLUSIVE = "PROMOTE", "ROLLBACK", "INCONCLUSIVE"
EXIT_CODES = {PROMOTE: 0, ROLLBACK: 1, VERDICT_INCONCLUSIVE: 3}


@dataclass(frozen=True)
class Verdict:
    decision: str
    reason: str

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self.decision]


def decide(gates: Sequence[Any], results: Sequence[Any]) -> Verdict:
    """gates[i] (GateBase) produced results[i] (CheckResult)."""
    binding = [(g, r) for g, r in zip(gates, results) if not g.informative]
    failed = [g.id for g, r in binding if r.status == FAIL]
    unsure = [g.id for g, r in binding if r.status == INCONCLUSIVE]
    if failed:
        return Verdict(ROLLBACK, "failed: " + ", ".join(failed))
    if unsure:
        return Verdict(VERDICT_INCONCLUSIVE, "undecided: " + ", ".join(unsure))
    if not binding:
        return Verdict(VERDICT_INCONCLUSIVE, "no binding gate (all are informative)")
    return Verdict(PROMOTE, f"all {len(binding)} binding gates passed")
