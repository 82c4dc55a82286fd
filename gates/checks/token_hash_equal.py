"""token_hash_equal: the same requests produce the same tokens.

compare: arms       -- each request key in the baseline has the same token sha256 in the candidate
                       (layout-only changes: a kernel swap must not change a single token)
         within_arm -- inside each listed arm, requests of one group (reruns, other batch sizes)
                       share one token sha256 (determinism / batch invariance)
"""
from __future__ import annotations

from collections import defaultdict
from typing import Literal, Optional

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

    def evaluate(self, ev: Evidence, cfg: Config) -> CheckResult:
        if cfg.compare == "arms":
            return self._across(ev, cfg)
        return self._within(ev, cfg)

    @staticmethod
    def _rows(ev: Evidence, arm: str, workload: Optional[str]) -> list[dict]:
        return [r for r in ev.requests(arm, workload) if r["token_sha256"] and not r["error"]]

    def _across(self, ev: Evidence, cfg: Config) -> CheckResult:
        base = {(r["workload"], r["request_key"]): r["token_sha256"] for r in self._rows(ev, "baseline", cfg.workload)}
        cand = {(r["workload"], r["request_key"]): r["token_sha256"] for r in self._rows(ev, "candidate", cfg.workload)}
        shared = sorted(set(base) & set(cand))
        diff = [k for k in shared if base[k] != cand[k]]
        stat = {"paired": len(shared), "different": len(diff), "baseline_only": len(set(base) - set(cand)),
                "candidate_only": len(set(cand) - set(base))}
        evidence = {"different": ["/".join(k) for k in diff[:MAX_LISTED]]}
        if not shared:
            return CheckResult(INCONCLUSIVE, "no request was run in both arms", stat, evidence)
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
