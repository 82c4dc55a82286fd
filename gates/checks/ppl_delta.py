"""ppl_delta: the candidate's perplexity on the same segments is at most `max_relative` worse.

Statistic: relative PPL change exp((NLL_c - NLL_b) / tokens) - 1 over all paired segments, with a
paired bootstrap CI over segments. PASS when the whole interval is <= max_relative, FAIL when the
whole interval is above it, INCONCLUSIVE when it straddles the bound or segments are too few.
"""
from __future__ import annotations

from typing import Literal

import numpy as np
from pydantic import Field

from onecat.gates.checks.base import INCONCLUSIVE, Check, CheckResult, Evidence, decide_upper_bound
from onecat.gates.contract import GateBase
from onecat.gates.registry import register_check
from onecat.gates.stats import bootstrap_ci


def segment_table(ev: Evidence, arm: str, workload: str) -> dict[str, tuple[float, float]]:
    """metric key -> (sum NLL, scored tokens) from the ppl runner's per-segment metrics."""
    nll = {m["key"]: m["value"] for m in ev.metrics(arm, workload, "segment_nll")}
    tok = {m["key"]: m["value"] for m in ev.metrics(arm, workload, "segment_tokens")}
    return {k: (nll[k], tok[k]) for k in nll if k in tok}


@register_check("ppl_delta")
class PplDelta(Check):
    class Config(GateBase):
        check: Literal["ppl_delta"] = "ppl_delta"
        workload: str = "ppl"
        max_relative: float  # e.g. 0.01 = candidate PPL at most 1% above baseline
        confidence: float = Field(default=0.95, gt=0.5, lt=1.0)
        min_segments: int = Field(default=2, ge=2)

    def evaluate(self, ev: Evidence, cfg: Config) -> CheckResult:
        base = segment_table(ev, "baseline", cfg.workload)
        cand = segment_table(ev, "candidate", cfg.workload)
        keys = sorted(set(base) & set(cand))
        mismatched = [k for k in keys if base[k][1] != cand[k][1]]
        stat = {"segments": len(keys), "max_relative": cfg.max_relative}
        if mismatched:
            return CheckResult(INCONCLUSIVE, f"{len(mismatched)} segments scored a different number of tokens "
                                             "in the two arms; not comparable", stat, {"segments": mismatched[:10]})
        if len(keys) < cfg.min_segments:
            return CheckResult(INCONCLUSIVE, f"{len(keys)} paired segments (< {cfg.min_segments})", stat)
        nb = np.array([base[k][0] for k in keys])
        nc = np.array([cand[k][0] for k in keys])
        nt = np.array([base[k][1] for k in keys])

        def rel(i: np.ndarray) -> float:
            return float(np.expm1((nc[i].sum() - nb[i].sum()) / nt[i].sum()))

        ci = bootstrap_ci(len(keys), rel, cfg.confidence)
        ppl_b, ppl_c = float(np.exp(nb.sum() / nt.sum())), float(np.exp(nc.sum() / nt.sum()))
        stat.update(ci.as_dict(), ppl_baseline=ppl_b, ppl_candidate=ppl_c)
        per_seg = {k: float(np.expm1((cand[k][0] - base[k][0]) / base[k][1])) for k in keys}
        status = decide_upper_bound(ci.low, ci.high, cfg.max_relative)
        summary = (f"PPL {ppl_b:.4f} -> {ppl_c:.4f}, relative {ci.estimate:+.2e} "
                   f"[{ci.low:+.2e}, {ci.high:+.2e}] vs bound {cfg.max_relative:+.2e}")
        return CheckResult(status, summary, stat, {"per_segment_relative": per_seg})
