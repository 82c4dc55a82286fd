"""Shared logic of the 'at most this share of bad outputs' checks (capped, invalid).

The candidate's rate of flagged generations must stay at or below `max_rate`: PASS when the observed
rate is within it, FAIL when even the lower Wilson bound is above it (the excess is real),
INCONCLUSIVE in between or with too few samples.
`max_increase` bounds the rise over the baseline the same way, paired by request (exact McNemar).
"""
from __future__ import annotations

from typing import Callable, Optional

from pydantic import Field

from onecat.gates.checks.base import (FAIL, INCONCLUSIVE, PASS, CheckResult, Evidence, combine,
                                      decide_paired_loss)
from onecat.gates.contract import GateBase
from onecat.gates.stats import mcnemar_exact, wilson_interval


class MaxRateConfig(GateBase):
    workload: Optional[str] = None  # default: all workloads
    max_rate: Optional[float] = Field(default=None, ge=0.0, le=1.0)
    max_increase: Optional[float] = Field(default=None, ge=0.0, le=1.0)
    min_samples: int = Field(default=10, ge=1)
    alpha: float = Field(default=0.05, gt=0.0, lt=1.0)


def evaluate_max_rate(ev: Evidence, cfg: MaxRateConfig, flag: Callable[[dict], bool],
                      eligible: Callable[[dict], bool], what: str) -> CheckResult:
    if cfg.max_rate is None and cfg.max_increase is None:
        return CheckResult(INCONCLUSIVE, "no bound given (set max_rate and/or max_increase)", {})
    rows = {arm: {(r["workload"], r["request_key"]): r for r in ev.requests(arm, cfg.workload)
                  if eligible(r) and not r["error"]} for arm in ("baseline", "candidate")}
    stat: dict = {}
    for arm, rs in rows.items():
        n, k = len(rs), sum(1 for r in rs.values() if flag(r))
        lo, hi = wilson_interval(k, n)
        stat[arm] = {"n": n, what: k, "rate": k / n if n else None, "wilson_low": lo, "wilson_high": hi}
    c = stat["candidate"]
    if c["n"] < cfg.min_samples:
        return CheckResult(INCONCLUSIVE, f"{c['n']} candidate generations (< {cfg.min_samples})", stat)
    verdicts, notes = [], []
    if cfg.max_rate is not None:
        verdicts.append(PASS if c["rate"] <= cfg.max_rate else FAIL if c["wilson_low"] > cfg.max_rate
                        else INCONCLUSIVE)
        notes.append(f"candidate {what} {c[what]}/{c['n']} = {c['rate']:.3f} vs max {cfg.max_rate}")
    if cfg.max_increase is not None:
        b = stat["baseline"]
        paired = sorted(set(rows["baseline"]) & set(rows["candidate"]))
        if b["n"] < cfg.min_samples or not paired:
            verdicts.append(INCONCLUSIVE)
            notes.append(f"{b['n']} baseline generations (< {cfg.min_samples})")
        else:
            rise = c["rate"] - b["rate"]
            # McNemar on "not flagged": a real increase shows as baseline-only successes
            mc = mcnemar_exact([not flag(rows["baseline"][k]) for k in paired],
                               [not flag(rows["candidate"][k]) for k in paired])
            stat["increase"], stat["mcnemar"] = rise, mc.as_dict()
            verdicts.append(decide_paired_loss(rise, cfg.max_increase, mc, cfg.alpha))
            notes.append(f"increase {rise:+.3f} vs max {cfg.max_increase} (McNemar p={mc.p_value:.3g})")
    return CheckResult(combine(verdicts), "; ".join(notes), stat)
