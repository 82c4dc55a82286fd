"""acceptance_min: the candidate's speculative decoding moves at least `min_length` tokens per round.

Mean acceptance length = 1 + accepted draft tokens / drafts (vLLM's definition), pooled over the
candidate's requests of the workload, with a bootstrap CI over requests. PASS when the lower end
reaches min_length, FAIL when the upper end is below it, INCONCLUSIVE otherwise or with fewer than
`min_drafts` drafts (for example when the arm does not speculate at all).
"""
from __future__ import annotations

import json
from typing import Literal, Optional

import numpy as np
from pydantic import Field

from onecat.gates.checks.base import FAIL, INCONCLUSIVE, PASS, Check, CheckResult, Evidence
from onecat.gates.contract import GateBase
from onecat.gates.registry import register_check


@register_check("acceptance_min")
class AcceptanceMin(Check):
    class Config(GateBase):
        check: Literal["acceptance_min"] = "acceptance_min"
        workload: Optional[str] = None
        min_length: float = Field(ge=1.0)
        min_drafts: int = Field(default=20, ge=1)
        confidence: float = Field(default=0.95, gt=0.5, lt=1.0)
        bootstrap: int = Field(default=2000, ge=100)

    def evaluate(self, ev: Evidence, cfg: Config) -> CheckResult:
        rows = [r for r in ev.requests("candidate", cfg.workload) if not r["error"]]
        drafts = np.array([r["spec_num_drafts"] or 0 for r in rows], dtype=float)
        accepted = np.array([r["spec_num_accepted_tokens"] or 0 for r in rows], dtype=float)
        positions = [json.loads(r["spec_accepted_per_position_json"] or "[]") for r in rows]
        per_pos = np.zeros(max((len(pp) for pp in positions), default=0))
        for pp in positions:
            per_pos[:len(pp)] += pp
        total = float(drafts.sum())
        stat = {"requests": len(rows), "drafts": total, "accepted_tokens": float(accepted.sum()),
                "accepted_per_position": per_pos.tolist(), "min_length": cfg.min_length}
        if total < cfg.min_drafts:
            return CheckResult(INCONCLUSIVE, f"{int(total)} drafts (< {cfg.min_drafts}); no acceptance evidence", stat)
        length = 1.0 + accepted.sum() / total
        rng = np.random.default_rng(0)
        idx = rng.integers(0, len(rows), size=(cfg.bootstrap, len(rows)))
        d, a = drafts[idx].sum(axis=1), accepted[idx].sum(axis=1)
        boot = 1.0 + a[d > 0] / d[d > 0]
        tail = (1 - cfg.confidence) / 2
        lo, hi = (float(np.quantile(boot, tail)), float(np.quantile(boot, 1 - tail))) if len(boot) else (length, length)
        stat.update({"acceptance_length": length, "ci_low": lo, "ci_high": hi})
        status = PASS if lo >= cfg.min_length else FAIL if hi < cfg.min_length else INCONCLUSIVE
        return CheckResult(status, f"mean acceptance length {length:.2f} [{lo:.2f}, {hi:.2f}] vs min {cfg.min_length}",
                           stat)
