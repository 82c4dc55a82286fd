"""invalid_outputs_max: few generations may be corrupt (U+FFFD replacement characters or a
repetition loop), on every generation the workload made.

Bounds: `max_rate` on the candidate, `max_increase` over the baseline (see _max_rate). Schema
validity of structured outputs is a per-item measure, gated with task_score.
"""
from __future__ import annotations

from typing import Literal

from onecat.gates.checks._max_rate import MaxRateConfig, evaluate_max_rate
from onecat.gates.checks.base import Check, CheckResult, Evidence
from onecat.gates.registry import register_check


@register_check("invalid_outputs_max")
class InvalidOutputsMax(Check):
    class Config(MaxRateConfig):
        check: Literal["invalid_outputs_max"] = "invalid_outputs_max"

    def evaluate(self, ev: Evidence, cfg: Config) -> CheckResult:
        return evaluate_max_rate(ev, cfg, flag=lambda r: bool(r["repetition_loop"]) or (r["replacement_chars"] or 0) > 0,
                                 eligible=lambda r: True, what="invalid")
