"""The gate-check interface: compare the candidate arm with the baseline arm of one stored run.

Adding a check is one file in gates/checks/ plus one decorator line:

    @register_check("my_check")
    class MyCheck(Check):
        class Config(GateBase):                       # pydantic, extra keys refused
            check: Literal["my_check"] = "my_check"
            workload: str
            bound: float

        def evaluate(self, ev: Evidence, cfg: Config) -> CheckResult:
            base = ev.requests("baseline", cfg.workload)      # list[dict] rows from the store
            ...
            return CheckResult(PASS, "why", statistic={...}, evidence={...})

A check answers PASS, FAIL, or INCONCLUSIVE (the evidence is too thin or the interval straddles
the bound); statistic + evidence are stored with the result and shown in the report.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional

from onecat.gates.contract import GateBase
from onecat.results.store import Store

PASS, FAIL, INCONCLUSIVE = "pass", "fail", "inconclusive"


@dataclass
class CheckResult:
    status: str
    summary: str
    statistic: dict[str, Any] = field(default_factory=dict)
    evidence: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.status not in (PASS, FAIL, INCONCLUSIVE):
            raise ValueError(f"check status {self.status!r}; use pass, fail or inconclusive")


class Evidence:
    """Read-only view of one run's rows for checks (backed by the results store)."""

    def __init__(self, store: Store, run_id: str):
        self.store, self.run_id = store, run_id

    def requests(self, arm: str, workload: Optional[str] = None) -> list[dict]:
        return self.store.requests(self.run_id, arm, workload)

    def items(self, arm: str, workload: Optional[str] = None) -> list[dict]:
        return self.store.items(self.run_id, arm, workload)

    def metrics(self, arm: str, workload: Optional[str] = None, name: Optional[str] = None) -> list[dict]:
        return self.store.metrics(self.run_id, arm, workload, name)


class Check:
    Config: ClassVar[type[GateBase]]

    def evaluate(self, ev: Evidence, cfg: Any) -> CheckResult:
        raise NotImplementedError


def decide_lower_bound(low: float, high: float, bound: float) -> str:
    """Interval vs "at least `bound`": PASS if all above, FAIL if all below, else INCONCLUSIVE."""
    if low >= bound:
        return PASS
    if high < bound:
        return FAIL
    return INCONCLUSIVE


def decide_upper_bound(low: float, high: float, bound: float) -> str:
    """Interval vs "at most `bound`"."""
    if high <= bound:
        return PASS
    if low > bound:
        return FAIL
    return INCONCLUSIVE


def decide_paired_loss(loss: float, max_loss: float, mc: Any, alpha: float) -> str:
    """A rate that may worsen by at most `max_loss`: PASS within it; FAIL only when an exact McNemar
    test on the paired items says the loss is real (baseline-only successes dominate); else
    INCONCLUSIVE."""
    if loss <= max_loss:
        return PASS
    if mc.p_value < alpha and mc.baseline_only > mc.candidate_only:
        return FAIL
    return INCONCLUSIVE


def combine(verdicts: list[str]) -> str:
    """Any FAIL fails; otherwise any INCONCLUSIVE is inconclusive; otherwise PASS."""
    return FAIL if FAIL in verdicts else INCONCLUSIVE if INCONCLUSIVE in verdicts else PASS
