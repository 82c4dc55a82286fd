"""not_slower: the candidate is not slower than the baseline by more than `tolerance` (a fraction).

The same interleaved ratio statistic as `speedup`, judged against 1 - tolerance.
"""
from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field

from onecat.gates.checks.base import Check, CheckResult, Evidence
from onecat.gates.checks.speedup import speed_result
from onecat.gates.contract import GateBase
from onecat.gates.registry import register_check


@register_check("not_slower")
class NotSlower(Check):
    class Config(GateBase):
        check: Literal["not_slower"] = "not_slower"
        workload: str
        metric: str = "decode_tok_s"
        keys: Optional[list[str]] = None
        tolerance: float = Field(default=0.05, ge=0.0, lt=1.0)
        confidence: float = Field(default=0.95, gt=0.5, lt=1.0)
        min_observations: int = Field(default=3, ge=2)

    def evaluate(self, ev: Evidence, cfg: Config) -> CheckResult:
        return speed_result(ev, cfg.workload, cfg.metric, cfg.keys, 1.0 - cfg.tolerance, cfg.confidence,
                            cfg.min_observations, "floor")
