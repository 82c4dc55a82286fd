"""capped_outputs_max: few generations may run into the token cap (reported apart from task failures).

Counts generations that were free to stop (natural_stop_eligible) and ended at the cap instead.
Bounds: `max_rate` on the candidate, `max_increase` over the baseline (see _max_rate).
"""
from __future__ import annotations

from typing import Literal

from onecat.gates.checks._max_rate import MaxRateConfig, evaluate_max_rate
from onecat.gates.checks.base import Check, CheckResult, Evidence
from onecat.gates.registry import register_check


@register_check("capped_outputs_max")
class CappedOutputsMax(Check):
    class Config(MaxRateConfig):
        check: Literal["capped_outputs_max"] = "capped_outputs_max"

    def evaluate(self, ev: Evidence, cfg: Config) -> CheckResult:
        return evaluate_max_rate(ev, cfg, flag=lambda r: bool(r["capped"]),
                                 eligible=lambda r: bool(r["natural_stop_eligible"]), what="capped")
