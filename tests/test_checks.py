"""Each gate check on synthetic rows where the right answer is known, plus the verdict rule."""
import math

import numpy as np
import pytest

from onecat.gates.checks.base import FAIL, INCONCLUSIVE, PASS, Evidence
from onecat.gates.checks.natural_stop_rate import NaturalStopRate
from onecat.gates.checks.not_slower import NotSlower
from onecat.gates.checks.ppl_delta import PplDelta
from onecat.gates.checks.speedup import Speedup
from onecat.gates.checks.task_score import TaskScore
from onecat.gates.checks.token_hash_equal import TokenHashEqual
from onecat.results.records import ItemOutcome, Metric, RequestRecord
from onecat.gates.stats import mcnemar_exact, paired_bootstrap_ci, ratio_bootstrap_ci
from onecat.gates.verdict import EXIT_CODES, decide
from onecat.results.store import Store

RUN = "r1"


@pytest.fixture
def store():
    s = Store(":memory:")
    yield s
    s.close()


def ev(store):
    return Evidence(store, RUN)


def add_requests(store, arm, workload, hashes, groups=None, stops=None):
    for i, h in enumerate(hashes):
        store.add_request(RUN, arm, workload, RequestRecord(
            request_key=f"k{i}", determinism_group=groups[i] if groups else None, token_sha256=h,
            natural_stop=stops[i] if stops else True, capped=not (stops[i] if stops else True)))


def add_segments(store, arm, nll_per_token, tokens=100):
    for i, v in enumerate(nll_per_token):
        store.add_metric(RUN, arm, "ppl", Metric("segment_nll", v * tokens, "nats", key=f"segment={i}"))
        store.add_metric(RUN, arm, "ppl", Metric("segment_tokens", tokens, "tokens", key=f"segment={i}"))


def add_speed(store, arm, values, key="bs=1"):
    for r, v in enumerate(values):
        store.add_metric(RUN, arm, "tp", Metric("decode_tok_s", v, "tok/s", key=key, repeat=r))


def cfg(check, **kw):
    return check.Config(**kw)


# ------------------------------------------------------------------ token_hash_equal
def test_token_hash_equal_across_arms(store):
    add_requests(store, "baseline", "det", ["a", "b", "c"])
    add_requests(store, "candidate", "det", ["a", "b", "c"])
    assert TokenHashEqual().evaluate(ev(store), cfg(TokenHashEqual)).status == PASS
    store.add_request(RUN, "candidate", "det", RequestRecord(request_key="k2", token_sha256="X"))
    res = TokenHashEqual().evaluate(ev(store), cfg(TokenHashEqual))
    assert res.status == FAIL and res.statistic["different"] == 1 and res.evidence["different"] == ["det/k2"]


def test_token_hash_equal_within_arm_and_inconclusive(store):
    assert TokenHashEqual().evaluate(ev(store), cfg(TokenHashEqual)).status == INCONCLUSIVE
    add_requests(store, "baseline", "det", ["a", "a", "b", "b"], groups=["g0", "g0", "g1", "g1"])
    add_requests(store, "candidate", "det", ["a", "a", "b", "c"], groups=["g0", "g0", "g1", "g1"])
    c = cfg(TokenHashEqual, compare="within_arm", arms=["baseline"])
    assert TokenHashEqual().evaluate(ev(store), c).status == PASS
    res = TokenHashEqual().evaluate(ev(store), cfg(TokenHashEqual, compare="within_arm"))
    assert res.status == FAIL and res.statistic["candidate"] == {"groups": 2, "inconsistent": 1}


def _generation(key, tokens, steps):
    """A request row whose generation is `tokens`, with each step's logprobs {token: logprob}."""
    return RequestRecord(request_key=key, token_sha256=str(tokens),
                         extra={"token_ids": tokens, "step_logprobs": [[[t, lp] for t, lp in s.items()] for s in steps]})


def test_token_hash_equal_near_tie_rule(store):
    """A pair that parts where both arms had the two choices within `near_tie` nats passes; one whose
    choices were far apart, or without recorded logprobs, fails."""
    same = {5: -0.1, 6: -2.5}
    store.add_request(RUN, "baseline", "det", _generation("k0", [5, 7], [same, {7: -0.2, 8: -3.0}]))
    store.add_request(RUN, "candidate", "det", _generation("k0", [5, 8], [same, {8: -0.60, 7: -0.61}]))
    store.add_request(RUN, "baseline", "det", _generation("k1", [1], [{1: -0.3, 2: -0.31}]))
    store.add_request(RUN, "candidate", "det", _generation("k1", [2], [{2: -0.30, 1: -0.305}]))
    plain = TokenHashEqual().evaluate(ev(store), cfg(TokenHashEqual))
    assert plain.status == FAIL and plain.statistic["different"] == 2
    # k0: baseline led by 2.8 nats at the parting token; k1: 0.01 / 0.005
    res = TokenHashEqual().evaluate(ev(store), cfg(TokenHashEqual, near_tie=0.05))
    assert res.status == FAIL and res.evidence["different"] == ["det/k0"]
    assert res.statistic["near_ties"] == 1 and res.evidence["gaps"]["det/k1"] == pytest.approx(0.01)
    store.add_request(RUN, "candidate", "det", _generation("k0", [5, 7], [same, {7: -0.2, 8: -3.0}]))
    res = TokenHashEqual().evaluate(ev(store), cfg(TokenHashEqual, near_tie=0.05))
    assert res.status == PASS and res.statistic == {**res.statistic, "different": 1, "near_ties": 1}
    store.add_request(RUN, "candidate", "det", RequestRecord(request_key="k1", token_sha256="[2]"))  # no logprobs
    assert TokenHashEqual().evaluate(ev(store), cfg(TokenHashEqual, near_tie=0.05)).status == FAIL


# ------------------------------------------------------------------ ppl_delta
def test_ppl_delta_pass_fail_inconclusive(store):
    rng = np.random.default_rng(0)
    base = 2.0 + rng.normal(0, 0.2, 16)
    add_segments(store, "baseline", base)
    add_segments(store, "candidate", base + 0.001)  # +0.1% PPL on every segment
    res = PplDelta().evaluate(ev(store), cfg(PplDelta, max_relative=0.01))
    assert res.status == PASS
    assert res.statistic["estimate"] == pytest.approx(math.expm1(0.001), rel=1e-6)
    assert PplDelta().evaluate(ev(store), cfg(PplDelta, max_relative=0.0005)).status == FAIL


def test_ppl_delta_straddling_bound_is_inconclusive(store):
    rng = np.random.default_rng(1)
    base = 2.0 + rng.normal(0, 0.2, 8)
    noise = rng.normal(0, 0.02, 8)  # candidate noisy around +0.5%: CI straddles a 0.5% bound
    add_segments(store, "baseline", base)
    add_segments(store, "candidate", base + 0.005 + noise - noise.mean())
    res = PplDelta().evaluate(ev(store), cfg(PplDelta, max_relative=math.expm1(0.005)))
    assert res.status == INCONCLUSIVE
    assert res.statistic["low"] < math.expm1(0.005) < res.statistic["high"]


def test_ppl_delta_too_few_segments(store):
    add_segments(store, "baseline", [2.0])
    add_segments(store, "candidate", [2.0])
    assert PplDelta().evaluate(ev(store), cfg(PplDelta, max_relative=0.01)).status == INCONCLUSIVE


# ------------------------------------------------------------------ natural_stop_rate
def test_natural_stop_rate(store):
    add_requests(store, "baseline", "g", ["h"] * 40, stops=[True] * 40)
    add_requests(store, "candidate", "g", ["h"] * 40, stops=[True] * 36 + [False] * 4)
    assert NaturalStopRate().evaluate(ev(store), cfg(NaturalStopRate, min_rate=0.85)).status == PASS
    assert NaturalStopRate().evaluate(ev(store), cfg(NaturalStopRate, min_rate=0.95)).status == INCONCLUSIVE
    # 4 losses out of 40, all discordant one way: McNemar p = 2 * 0.5**4 = 0.125, not significant
    res = NaturalStopRate().evaluate(ev(store), cfg(NaturalStopRate, max_drop=0.0))
    assert res.status == INCONCLUSIVE and res.statistic["mcnemar"]["p_value"] == pytest.approx(0.125)


def test_natural_stop_rate_clear_failure(store):
    add_requests(store, "baseline", "g", ["h"] * 40, stops=[True] * 40)
    add_requests(store, "candidate", "g", ["h"] * 40, stops=[True] * 10 + [False] * 30)
    assert NaturalStopRate().evaluate(ev(store), cfg(NaturalStopRate, min_rate=0.9)).status == FAIL
    assert NaturalStopRate().evaluate(ev(store), cfg(NaturalStopRate, max_drop=0.05)).status == FAIL
    with pytest.raises(ValueError, match="min_rate and/or max_drop"):
        cfg(NaturalStopRate)


# ------------------------------------------------------------------ speedup / not_slower
def test_speedup_from_interleaved_repeats(store):
    add_speed(store, "baseline", [100, 102, 98, 101, 99])  # A/B/A: one more baseline repeat
    add_speed(store, "candidate", [150, 152, 149, 151])
    res = Speedup().evaluate(ev(store), cfg(Speedup, workload="tp", min_ratio=1.3))
    assert res.status == PASS and 1.45 < res.statistic["estimate"] < 1.55
    assert res.statistic["observations"] == 4
    assert Speedup().evaluate(ev(store), cfg(Speedup, workload="tp", min_ratio=2.0)).status == FAIL


def test_speed_checks_inconclusive_when_noisy_or_thin(store):
    add_speed(store, "baseline", [100, 60, 140, 70, 130])
    add_speed(store, "candidate", [120, 70, 150, 95])
    res = Speedup().evaluate(ev(store), cfg(Speedup, workload="tp", min_ratio=1.2))
    assert res.status == INCONCLUSIVE and res.statistic["low"] < 1.2 < res.statistic["high"]
    thin = Store(":memory:")
    add_speed(thin, "baseline", [100, 100])
    add_speed(thin, "candidate", [100])
    assert NotSlower().evaluate(Evidence(thin, RUN), cfg(NotSlower, workload="tp")).status == INCONCLUSIVE


def test_not_slower(store):
    add_speed(store, "baseline", [100, 101, 99, 100])
    add_speed(store, "candidate", [97, 98, 96])
    assert NotSlower().evaluate(ev(store), cfg(NotSlower, workload="tp", tolerance=0.05)).status == PASS
    assert NotSlower().evaluate(ev(store), cfg(NotSlower, workload="tp", tolerance=0.01)).status == FAIL


# ------------------------------------------------------------------ task_score
def add_items(store, arm, passed, measure="plus"):
    for i, p in enumerate(passed):
        store.add_item(RUN, arm, "task", ItemOutcome(item_id=f"t{i}", seed=0, passed={measure: p}))


def test_task_score_equal_better_worse(store):
    add_items(store, "baseline", [True] * 30 + [False] * 30)
    add_items(store, "candidate", [True] * 30 + [False] * 30)
    assert TaskScore().evaluate(ev(store), cfg(TaskScore, workload="task")).status == PASS
    worse = Store(":memory:")
    add_items(worse, "baseline", [True] * 40 + [False] * 20)
    add_items(worse, "candidate", [False] * 20 + [True] * 20 + [False] * 20)  # loses 20 items, gains none
    res = TaskScore().evaluate(Evidence(worse, RUN), cfg(TaskScore, workload="task"))
    assert res.status == FAIL and res.statistic["plus"]["baseline_only"] == 20
    slightly = Store(":memory:")
    add_items(slightly, "baseline", [True] * 31 + [False] * 29)
    add_items(slightly, "candidate", [False] + [True] * 30 + [False] * 29)  # one item lost: not significant
    assert TaskScore().evaluate(Evidence(slightly, RUN), cfg(TaskScore, workload="task")).status == INCONCLUSIVE
    assert TaskScore().evaluate(Evidence(slightly, RUN), cfg(TaskScore, workload="task", margin=0.05)).status == PASS


# ------------------------------------------------------------------ statistics and verdict
def test_statistics_known_values():
    mc = mcnemar_exact([True, True, True, False], [False, False, False, False])
    assert (mc.baseline_only, mc.candidate_only) == (3, 0) and mc.p_value == pytest.approx(0.25)
    ci = paired_bootstrap_ci([1, 2, 3, 4], [2, 3, 4, 5])
    assert ci.estimate == ci.low == ci.high == 1.0
    r = ratio_bootstrap_ci([2, 4, 6], [1, 2, 3])
    assert r.estimate == r.low == r.high == 2.0


def test_verdict_rule():
    from onecat.gates.checks.base import CheckResult
    from onecat.gates.checks.ppl_delta import PplDelta as P

    g = P.Config(max_relative=0.1)
    info = P.Config(max_relative=0.1, informative=True)
    ok, bad, unsure = (CheckResult(s, "") for s in (PASS, FAIL, INCONCLUSIVE))
    assert decide([g, g], [ok, ok]).decision == "PROMOTE"
    assert decide([g, g], [ok, unsure]).decision == "INCONCLUSIVE"
    assert decide([g, g], [unsure, bad]).decision == "ROLLBACK"
    assert decide([g, info], [ok, bad]).decision == "PROMOTE"  # informative gates never decide
    assert EXIT_CODES == {"PROMOTE": 0, "ROLLBACK": 1, "INCONCLUSIVE": 3}


def test_generation_health_fields():
    from onecat.engine.outputs import RequestOutput
    from onecat.gates.health import LOOP_MIN_TOKENS, generation_health, max_repeat_run

    assert max_repeat_run([1, 2, 3, 4, 5]) == 0
    assert max_repeat_run([7, 7, 7, 7]) == 4
    assert max_repeat_run([1, 5, 6, 5, 6, 5, 6, 9]) == 6  # "5 6" three times
    loop = RequestOutput("r", None, [1], [3, 4] * LOOP_MIN_TOKENS, "ab\ufffd", "length")
    h = generation_health(loop)
    assert h["capped"] and not h["natural_stop"] and h["repetition_loop"] and h["replacement_chars"] == 1
    ok = RequestOutput("r", None, [1], [5, 6, 2], "", "stop")

    class Tok:
        def decode(self, ids):
            return "hi"

    h2 = generation_health(ok, Tok())
    assert h2["natural_stop"] and not h2["repetition_loop"] and h2["text_sha256"] == generation_health(
        RequestOutput("r", None, [9], [5, 6, 2], "hi", "stop"))["text_sha256"]
    assert h2["token_sha256"] != h["token_sha256"]


# ------------------------------------------------------------------ capped / invalid outputs
def test_capped_outputs_max(store):
    from onecat.gates.checks.capped_outputs_max import CappedOutputsMax

    add_requests(store, "baseline", "g", ["h"] * 40, stops=[True] * 40)
    add_requests(store, "candidate", "g", ["h"] * 40, stops=[True] * 38 + [False] * 2)
    assert CappedOutputsMax().evaluate(ev(store), cfg(CappedOutputsMax, max_rate=0.1)).status == PASS
    assert CappedOutputsMax().evaluate(ev(store), cfg(CappedOutputsMax, max_rate=0.02)).status == INCONCLUSIVE
    res = CappedOutputsMax().evaluate(ev(store), cfg(CappedOutputsMax, max_increase=0.0))
    assert res.status == INCONCLUSIVE and res.statistic["increase"] == pytest.approx(0.05)


def test_capped_outputs_max_clear_failure(store):
    from onecat.gates.checks.capped_outputs_max import CappedOutputsMax

    add_requests(store, "baseline", "g", ["h"] * 40, stops=[True] * 40)
    add_requests(store, "candidate", "g", ["h"] * 40, stops=[True] * 20 + [False] * 20)
    assert CappedOutputsMax().evaluate(ev(store), cfg(CappedOutputsMax, max_rate=0.1)).status == FAIL
    assert CappedOutputsMax().evaluate(ev(store), cfg(CappedOutputsMax, max_increase=0.05)).status == FAIL


def test_invalid_outputs_max(store):
    from onecat.gates.checks.invalid_outputs_max import InvalidOutputsMax

    for i in range(30):
        store.add_request(RUN, "candidate", "g", RequestRecord(request_key=f"k{i}", token_sha256="h",
                                                               replacement_chars=1 if i < 15 else 0,
                                                               repetition_loop=i == 20))
    res = InvalidOutputsMax().evaluate(ev(store), cfg(InvalidOutputsMax, max_rate=0.1))
    assert res.status == FAIL and res.statistic["candidate"]["invalid"] == 16
    assert InvalidOutputsMax().evaluate(ev(store), cfg(InvalidOutputsMax, max_rate=0.6)).status == PASS
