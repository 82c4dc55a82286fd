"""Failed requests are never evidence: the rule every binding gate is held to.

A request that errored or was aborted (refused by the engine, an HTTP error, a timeout) produced no
tokens worth timing or scoring. Runners store its row with the error, but no throughput, latency or
task figure is derived from it (`RunSink` drops task items of failed requests; the throughput
runners drop the whole timed batch). A check that only reads the surviving figures could still
pass (a candidate that refuses every request "prefills" at 1e11 tok/s), so after each check runs,
`hold_to_failures` overrides its answer from the failed requests of the workloads it judges:

    baseline failed a larger share than the candidate, or the same share  -> INCONCLUSIVE
        (the reference is broken: no comparison against it can be trusted)
    candidate failed a larger share than the baseline                   -> FAIL
    neither failed                                                      -> the check's own answer

The summary names how many requests failed in each arm and the first errors, so the report says
why without opening the store.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

from onecat.gates.checks.base import FAIL, INCONCLUSIVE, CheckResult
from onecat.results.records import is_failed_request

SHOWN_ERRORS = 3  # distinct error texts quoted per arm in a summary
ERROR_TEXT_CHARS = 200


@dataclass
class ArmFailures:
    total: int = 0
    failed: list[dict] = field(default_factory=list)  # {"workload", "request_key", "error"}

    @property
    def share(self) -> float:
        return len(self.failed) / self.total if self.total else 0.0

    def describe(self, arm: str) -> str:
        errors = list(dict.fromkeys(f["error"] for f in self.failed))
        quoted = "; ".join(repr(e) for e in errors[:SHOWN_ERRORS])
        more = f" (+{len(errors) - SHOWN_ERRORS} other errors)" if len(errors) > SHOWN_ERRORS else ""
        return f"{arm}: {len(self.failed)} of {self.total} requests failed: {quoted}{more}"


def arm_failures(ev: Any, arm: str, workloads: Iterable[str]) -> ArmFailures:
    out = ArmFailures()
    for w in workloads:
        for row in ev.requests(arm, w):
            out.total += 1
            if is_failed_request(row):
                text = str(row.get("error") or f"finish_reason={row.get('finish_reason')}")[:ERROR_TEXT_CHARS]
                out.failed.append({"workload": w, "request_key": row.get("request_key"), "error": text})
    return out


def judged_workloads(gate: Any, all_workloads: list[str]) -> list[str]:
    """The workloads a gate reads: its `workload` field, or every workload when it has none."""
    w: Optional[str] = getattr(gate, "workload", None)
    return [w] if w else list(all_workloads)


def hold_to_failures(result: CheckResult, ev: Any, workloads: list[str]) -> CheckResult:
    """The check's result, overridden when either arm had failed requests in `workloads`."""
    arms = {arm: arm_failures(ev, arm, workloads) for arm in ("baseline", "candidate")}
    base, cand = arms["baseline"], arms["candidate"]
    if not base.failed and not cand.failed:
        return result
    status = FAIL if cand.share > base.share else INCONCLUSIVE
    why = ("the candidate failed requests" if status == FAIL else "the baseline failed requests, so nothing can be "
           "compared with it")
    parts = [a.describe(name) for name, a in arms.items() if a.failed]
    summary = f"{why} ({'; '.join(parts)}); was: {result.status.upper()} {result.summary}"
    statistic = dict(result.statistic, failed_requests={n: len(a.failed) for n, a in arms.items()},
                     requests={n: a.total for n, a in arms.items()})
    evidence = dict(result.evidence, failed_requests={n: a.failed[:50] for n, a in arms.items()})
    return CheckResult(status, summary, statistic, evidence)
