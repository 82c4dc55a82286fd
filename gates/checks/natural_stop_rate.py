"""natural_stop_rate: generations end on their own (EOS / stop string) rather than at the token cap.

Counts requests that were free to stop (natural_stop_eligible; fixed-length throughput requests are
not). `min_rate`: the candidate's rate must reach it (PASS at or above; FAIL when even the upper
Wilson bound is below; INCONCLUSIVE between). `max_drop`: the candidate may lose at most this much
rate versus the baseline (FAIL only when an exact McNemar test on paired requests says the loss is
real; INCONCLUSIVE otherwise). Loops and U+FFFD counts are reported alongside.
"""
from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field, model_validator

from onecat.gates.checks.base import (FAIL, INCONCLUSIVE, PASS, Check, CheckResult, Evidence, combine,
                                      decide_paired_loss)
from onecat.gates.contract import GateBase
from onecat.gates.registry import register_check
from onecat.gates.stats import mcnemar_exact, wilson_interval


@register_check("natural_stop_rate")
class NaturalStopRate(Check):
    class Config(GateBase):
        check: Literal["natural_stop_rate"] = "natural_stop_rate"
        workload: Optional[str] = None  # default: all workloads
        min_rate: Optional[float] = Field(default=None, ge=0.0, le=1.0)
        max_drop: Optional[float] = Field(default=None, ge=0.0, le=1.0)
        min_samples: int = Field(default=10, ge=1)
        alpha: float = Field(default=0.05, gt=0.0, lt=1.0)

        @model_validator(mode="after")
        def _one_bound(self):
            if self.min_rate is None and self.max_drop is None:
                raise ValueError("natural_stop_rate needs min_rate and/or max_drop")
            return self

    def evaluate(self, ev: Evidence, cfg: Config) -> CheckResult:
        rows = {arm: {(r["workload"], r["request_key"]): r for r in ev.requests(arm, cfg.workload)
                      if r["natural_stop_eligible"] and not r["error"]} for arm in ("baseline", "candidate")}
        stat: dict = {}
        for arm, rs in rows.items():
            n, k = len(rs), sum(1 for r in rs.values() if r["natural_stop"])
            lo, hi = wilson_interval(k, n)
            stat[arm] = {"n": n, "natural_stops": k, "rate": k / n if n else None, "wilson_low": lo, "wilson_high": hi,
                         "capped": sum(1 for r in rs.values() if r["capped"]),
                         "repetition_loops": sum(1 for r in rs.values() if r["repetition_loop"]),
                         "replacement_chars": sum(r["replacement_chars"] or 0 for r in rs.values())}
        c = stat["candidate"]
        if c["n"] < cfg.min_samples:
            return CheckResult(INCONCLUSIVE, f"{c['n']} eligible candidate generations (< {cfg.min_samples})", stat)
        verdicts, notes = [], []
        if cfg.min_rate is not None:
            if c["rate"] >= cfg.min_rate:
                verdicts.append(PASS)
            elif c["wilson_high"] < cfg.min_rate:
                verdicts.append(FAIL)
            else:
                verdicts.append(INCONCLUSIVE)
            notes.append(f"candidate {c['natural_stops']}/{c['n']} = {c['rate']:.3f} vs min {cfg.min_rate}")
        if cfg.max_drop is not None:
            b = stat["baseline"]
            if b["n"] < cfg.min_samples:
                verdicts.append(INCONCLUSIVE)
                notes.append(f"{b['n']} eligible baseline generations (< {cfg.min_samples})")
            else:
                drop = b["rate"] - c["rate"]
                paired = sorted(set(rows["baseline"]) & set(rows["candidate"]))
                mc = mcnemar_exact([bool(rows["baseline"][k]["natural_stop"]) for k in paired],
                                   [bool(rows["candidate"][k]["natural_stop"]) for k in paired])
                stat["drop"], stat["mcnemar"] = drop, mc.as_dict()
                verdicts.append(decide_paired_loss(drop, cfg.max_drop, mc, cfg.alpha))
                notes.append(f"drop {drop:+.3f} vs max {cfg.max_drop} (McNemar p={mc.p_value:.3g})")
        return CheckResult(combine(verdicts), "; ".join(notes), stat)
