"""task_score: per-item task outcomes of the candidate are not worse than the baseline's.

Reads the item_outcomes rows task runners write (one per item, seed and measure, e.g. EvalPlus
"base" and "plus", GSM8K "correct") and pairs them by (item, seed). For each measure:
    diff = candidate score - baseline score (fraction of items passed)
    PASS          diff >= -margin
    FAIL          diff < -margin and an exact McNemar test on the discordant pairs has p < alpha
    INCONCLUSIVE  diff < -margin but not significant, or fewer than min_items pairs
`margin: 0` asks for equal-or-better scores; the check is FAIL on any measure that fails.
"""
from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field

from onecat.gates.checks.base import FAIL, INCONCLUSIVE, PASS, Check, CheckResult, Evidence
from onecat.gates.contract import GateBase
from onecat.gates.registry import register_check
from onecat.gates.stats import mcnemar_exact


@register_check("task_score")
class TaskScore(Check):
    class Config(GateBase):
        check: Literal["task_score"] = "task_score"
        workload: str
        measures: Optional[list[str]] = None  # default: every measure the runner recorded
        margin: float = Field(default=0.0, ge=0.0, le=1.0)
        alpha: float = Field(default=0.05, gt=0.0, lt=1.0)
        min_items: int = Field(default=1, ge=1)

    def evaluate(self, ev: Evidence, cfg: Config) -> CheckResult:
        tables = {arm: {(r["item_id"], r["seed"], r["measure"]): bool(r["passed"])
                        for r in ev.items(arm, cfg.workload)} for arm in ("baseline", "candidate")}
        measures = cfg.measures or sorted({k[2] for t in tables.values() for k in t})
        stat, statuses, notes = {}, [], []
        if not measures:
            return CheckResult(INCONCLUSIVE, f"no item outcomes stored for workload {cfg.workload!r}", {})
        for m in measures:
            keys = sorted(k for k in tables["baseline"] if k[2] == m and k in tables["candidate"])
            if len(keys) < cfg.min_items:
                statuses.append(INCONCLUSIVE)
                stat[m] = {"pairs": len(keys)}
                notes.append(f"{m}: {len(keys)} paired items (< {cfg.min_items})")
                continue
            b = [tables["baseline"][k] for k in keys]
            c = [tables["candidate"][k] for k in keys]
            sb, sc = sum(b) / len(b), sum(c) / len(c)
            mc = mcnemar_exact(b, c)
            diff = sc - sb
            if diff >= -cfg.margin:
                status = PASS
            elif mc.p_value < cfg.alpha:
                status = FAIL
            else:
                status = INCONCLUSIVE
            statuses.append(status)
            stat[m] = {"pairs": len(keys), "baseline_score": sb, "candidate_score": sc, "diff": diff,
                       **mc.as_dict()}
            notes.append(f"{m}: {sb:.3f} -> {sc:.3f} (diff {diff:+.3f}, McNemar p={mc.p_value:.3g})")
        status = FAIL if FAIL in statuses else INCONCLUSIVE if INCONCLUSIVE in statuses else PASS
        return CheckResult(status, "; ".join(notes), stat)
