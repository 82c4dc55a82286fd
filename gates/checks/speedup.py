"""speedup: the candidate is at least `min_ratio` times as fast, from interleaved A/B/A repeats.

Each candidate repeat r of a throughput metric (per key, e.g. "bs=8") is divided by the mean of the
baseline repeats that bracket it (r and r+1; just r when arms were not interleaved). The statistic
is the geometric mean of those ratios with a paired bootstrap CI. PASS when the interval's lower
end reaches min_ratio, FAIL when its upper end is below, INCONCLUSIVE otherwise or when fewer than
`min_observations` ratios exist.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Literal, Optional

import numpy as np
from pydantic import Field

from onecat.gates.checks.base import INCONCLUSIVE, Check, CheckResult, Evidence, decide_lower_bound
from onecat.gates.contract import GateBase
from onecat.gates.registry import register_check
from onecat.gates.stats import paired_bootstrap_ci, ratio_bootstrap_ci


def bracketed_pairs(ev: Evidence, workload: str, metric: str, keys: Optional[list[str]],
                    candidate_metric: Optional[str] = None) -> list[tuple[str, int, float, float]]:
    """(key, repeat, candidate value, bracketing baseline mean) for every candidate repeat."""
    by = {arm: defaultdict(dict) for arm in ("baseline", "candidate")}
    names = {"baseline": metric, "candidate": candidate_metric or metric}
    for arm in by:
        for m in ev.metrics(arm, workload, names[arm]):
            if (keys is None or m["key"] in keys) and m["repeat"] is not None and m["value"] is not None:
                by[arm][m["key"]][int(m["repeat"])] = float(m["value"])
    out = []
    for key, reps in sorted(by["candidate"].items()):
        base = by["baseline"].get(key, {})
        for r, value in sorted(reps.items()):
            bracket = [base[i] for i in (r, r + 1) if i in base]
            if bracket and value > 0 and all(b > 0 for b in bracket):
                out.append((key, r, value, float(np.mean(bracket))))
    return out


def speed_result(ev: Evidence, workload: str, metric: str, keys: Optional[list[str]], bound: float,
                 confidence: float, min_observations: int, label: str,
                 candidate_metric: Optional[str] = None) -> CheckResult:
    pairs = bracketed_pairs(ev, workload, metric, keys, candidate_metric)
    stat: dict = {"metric": metric, "candidate_metric": candidate_metric or metric, "bound": bound,
                  "observations": len(pairs)}
    per_key = defaultdict(list)
    for key, _, c, b in pairs:
        per_key[key].append((c, b))
    evidence = {"pairs": [{"key": k, "repeat": r, "candidate": c, "baseline": b, "ratio": c / b}
                          for k, r, c, b in pairs]}
    per_key_ci = {}
    for key, cb in per_key.items():
        if len(cb) >= 2:
            per_key_ci[key] = ratio_bootstrap_ci([c for c, _ in cb], [b for _, b in cb], confidence).as_dict()
    evidence["per_key"] = per_key_ci
    if len(pairs) < min_observations:
        return CheckResult(INCONCLUSIVE, f"{len(pairs)} interleaved {metric} ratios (< {min_observations})",
                           stat, evidence)
    logc = np.log([c for _, _, c, _ in pairs])
    logb = np.log([b for _, _, _, b in pairs])
    ci = paired_bootstrap_ci(logb, logc, confidence=confidence)
    est, lo, hi = float(np.exp(ci.estimate)), float(np.exp(ci.low)), float(np.exp(ci.high))
    stat.update(estimate=est, low=lo, high=hi, confidence=confidence)
    status = decide_lower_bound(lo, hi, bound)
    return CheckResult(status, f"{metric} ratio {est:.3f} [{lo:.3f}, {hi:.3f}] vs {label} {bound:.3f}", stat, evidence)


@register_check("speedup")
class Speedup(Check):
    class Config(GateBase):
        check: Literal["speedup"] = "speedup"
        workload: str
        metric: str = "decode_tok_s"
        candidate_metric: Optional[str] = None  # e.g. spec_decode_tok_s vs the baseline's decode_tok_s
        keys: Optional[list[str]] = None  # e.g. ["bs=8"]; default all
        min_ratio: float = Field(gt=0.0)
        confidence: float = Field(default=0.95, gt=0.5, lt=1.0)
        min_observations: int = Field(default=3, ge=2)

    def evaluate(self, ev: Evidence, cfg: Config) -> CheckResult:
        return speed_result(ev, cfg.workload, cfg.metric, cfg.keys, cfg.min_ratio, cfg.confidence,
                            cfg.min_observations, "min ratio", cfg.candidate_metric)
