"""token_hash_equal: the same requests produce the same tokens.

compare: arms       -- each request key in the baseline has the same token sha256 in the candidate
                       (layout-only changes: a kernel swap must not change a single token)
near_tie: G         -- (arms, greedy) a pair that differs still passes when, at its first differing token,
                       each arm's choice led the other's by at most G nats in BOTH arms' logprobs: a
                       near-tie that a change of summation order (tensor parallel, another kernel) may flip.
                       Needs the steps' logprobs recorded (determinism workload `top_logprobs: 2`); a pair
                       without them, or whose choices are further apart, fails.
         within_arm -- inside each listed arm, requests of one group (reruns, other batch sizes)
                       share one token sha256 (determinism / batch invariance)
"""
from __future__ import annotations

import json
from collections import defaultdict
from typing import Literal, Optional

from pydantic import Field

from onecat.gates.checks.base import FAIL, INCONCLUSIVE, PASS, Check, CheckResult, Evidence
from onecat.gates.contract import GateBase
from onecat.gates.registry import register_check

MAX_LISTED = 10


@register_check("token_hash_equal")
class TokenHashEqual(Check):
    class Config(GateBase):
        check: Literal["token_hash_equal"] = "token_hash_equal"
        workload: Optional[str] = None  # default: every workload with generated tokens
        compare: Literal["arms", "within_arm"] = "arms"
        arms: list[Literal["baseline", "candidate"]] = ["baseline", "candidate"]  # for within_arm
        near_tie: Optional[float] = Field(default=None, gt=0)  # for arms: see the module docstring

    def evaluate(self, ev: Evidence, cfg: Config) -> CheckResult:
        if cfg.compare == "arms":
            return self._across(ev, cfg)
        return self._within(ev, cfg)

    @staticmethod
    def _rows(ev: Evidence, arm: str, workload: Optional[str]) -> list[dict]:
        return [r for r in ev.requests(arm, workload) if r["token_sha256"] and not r["error"]]

    def _across(self, ev: Evidence, cfg: Config) -> CheckResult:
        base = {(r["workload"], r["request_key"]): r for r in self._rows(ev, "baseline", cfg.workload)}
        cand = {(r["workload"], r["request_key"]): r for r in self._rows(ev, "candidate", cfg.workload)}
        shared = sorted(set(base) & set(cand))
        diff = [k for k in shared if base[k]["token_sha256"] != cand[k]["token_sha256"]]
        stat = {"paired": len(shared), "different": len(diff), "baseline_only": len(set(base) - set(cand)),
                "candidate_only": len(set(cand) - set(base))}
        evidence = {"different": ["/".join(k) for k in diff[:MAX_LISTED]]}
        if not shared:
            return CheckResult(INCONCLUSIVE, "no request was run in both arms", stat, evidence)
        if diff and cfg.near_tie is not None:
            gaps = {k: first_divergence_gap(base[k], cand[k]) for k in diff}
            far = [k for k, g in gaps.items() if g is None or g > cfg.near_tie]
            known = [g for g in gaps.values() if g is not None]
            stat.update({"near_ties": len(diff) - len(far), "max_gap": max(known) if known else None})
            evidence["gaps"] = {"/".join(k): gaps[k] for k in diff[:MAX_LISTED]}
            if not far:
                return CheckResult(PASS, f"{len(diff)} of {len(shared)} paired requests differ, each first at a "
                                         f"near-tie (largest gap {max(known):.2g} <= {cfg.near_tie:g} nats)", stat,
                                   evidence)
            evidence["different"] = ["/".join(k) for k in far[:MAX_LISTED]]
            return CheckResult(FAIL, f"{len(far)} of {len(shared)} paired requests differ beyond a near-tie "
                                     f"({cfg.near_tie:g} nats) or without recorded logprobs", stat, evidence)
        if diff:
            return CheckResult(FAIL, f"{len(diff)} of {len(shared)} paired requests differ in tokens", stat, evidence)
        return CheckResult(PASS, f"all {len(shared)} paired requests token-identical", stat, evidence)

    def _within(self, ev: Evidence, cfg: Config) -> CheckResult:
        stat, evidence, groups_total, bad_total = {}, {}, 0, 0
        for arm in cfg.arms:
            groups: dict[tuple, set[str]] = defaultdict(set)
            sizes: dict[tuple, int] = defaultdict(int)
            for r in self._rows(ev, arm, cfg.workload):
                if r["determinism_group"] is None:
                    continue
                group = (r["workload"], r["determinism_group"])
                groups[group].add(r["token_sha256"])
                sizes[group] += 1
            multi = [g for g in groups if sizes[g] >= 2]
            bad = [g for g in multi if len(groups[g]) > 1]
            stat[arm] = {"groups": len(multi), "inconsistent": len(bad)}
            evidence[arm] = ["/".join(map(str, g)) for g in bad[:MAX_LISTED]]
            groups_total += len(multi)
            bad_total += len(bad)
        if groups_total == 0:
            return CheckResult(INCONCLUSIVE, "no group with two or more requests to compare", stat, evidence)
        if bad_total:
            return CheckResult(FAIL, f"{bad_total} of {groups_total} request groups gave different tokens", stat,
                               evidence)
        return CheckResult(PASS, f"all {groups_total} request groups token-identical", stat, evidence)


def _steps(row: dict) -> tuple[list[int], list[dict[int, float]]] | None:
    extra = json.loads(row.get("extra_json") or "{}")
    if "token_ids" not in extra or "step_logprobs" not in extra:
        return None
    return extra["token_ids"], [{int(t): lp for t, lp in step} for step in extra["step_logprobs"]]


def first_divergence_gap(base_row: dict, cand_row: dict) -> float | None:
    """At the first token where the two generations part: how far (nats) each arm's own choice led the
    other arm's choice in its logprobs, the larger of the two; None when either arm lacks those logprobs
    (steps not recorded, or the other's choice outside its recorded likeliest tokens)."""
    a, b = _steps(base_row), _steps(cand_row)
    if a is None or b is None:
        return None
    (ta, la), (tb, lb) = a, b
    at = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), None)
    if at is None or at >= len(la) or at >= len(lb):
        return None  # one is a prefix of the other: they part at a stop, not at a choice
    x, y = ta[at], tb[at]
    if not {x, y} <= la[at].keys() or not {x, y} <= lb[at].keys():
        return None
    return max(la[at][x] - la[at][y], lb[at][y] - lb[at][x])
