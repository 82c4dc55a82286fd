"""A failed request is never evidence: a candidate (or baseline) whose requests fail cannot be promoted,
and a contract whose own numbers make its requests impossible is refused before anything loads."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).parent))
import gate_fakes  # noqa: E402 - registers the fake engine the contracts name

from onecat.cli.main import app  # noqa: E402
from onecat.gates.checks.base import FAIL, INCONCLUSIVE, PASS, CheckResult, Evidence  # noqa: E402
from onecat.gates.contract import ContractError  # noqa: E402
from onecat.gates.failures import hold_to_failures  # noqa: E402
from onecat.gates.gate_run import StoreSink, run_gate  # noqa: E402
from onecat.gates.verdict import PROMOTE, ROLLBACK, VERDICT_INCONCLUSIVE  # noqa: E402
from onecat.results.records import ItemOutcome, RequestRecord  # noqa: E402
from onecat.results.store import Store  # noqa: E402

REFUSAL = "the prompt has 64 tokens but max_model_len is 4; shorten the prompt or raise max_model_len"

SPEED_CONTRACT = """
name: refusing-arm
model: {source: "fake:tiny"}
engine: {backend: fake%(engine)s}
sampling: {temperature: 0.0, max_tokens: 8}
seeds: [0]
workloads:
  - {kind: prefill_throughput, input_len: 64, batch_sizes: [2], repeats: 3, warmup: 0}
  - {kind: determinism, num_prompts: 3, reruns: 2}
gates:
  - {check: speedup, workload: prefill_throughput, metric: prefill_tok_s, min_ratio: 1.05, min_observations: 2}
  - {check: token_hash_equal, workload: determinism, compare: arms}
"""


def _contract(tmp_path: Path, engine: str = "") -> Path:
    path = tmp_path / "c.yaml"
    path.write_text(SPEED_CONTRACT % {"engine": engine}, encoding="utf-8")
    return path


@pytest.fixture
def refuse(monkeypatch):
    def set_arms(*arms: str) -> None:
        monkeypatch.setattr(gate_fakes.FakeEngine, "refuse_arms", {a: REFUSAL for a in arms})
    return set_arms


def _gate(outcome, gate_id: str):
    return next(r for g, r in outcome.results if g.id == gate_id)


def test_candidate_that_refuses_every_request_is_rolled_back(tmp_path, refuse):
    refuse("candidate")
    db = tmp_path / "r.duckdb"
    outcome = run_gate(_contract(tmp_path), db, report_dir=tmp_path)
    assert outcome.verdict.decision == ROLLBACK
    speed = _gate(outcome, "speedup:prefill_throughput")
    assert speed.status == FAIL
    assert "candidate: 6 of 6 requests failed" in speed.summary and REFUSAL in speed.summary
    assert _gate(outcome, "token_hash_equal:determinism").status == FAIL
    with Store(db, read_only=True) as store:
        assert not store.metrics(outcome.run_id, "candidate", "prefill_throughput")  # no figure from a refusal
        assert store.metrics(outcome.run_id, "baseline", "prefill_throughput")
    report = outcome.report_path.read_text(encoding="utf-8")
    assert "## Failed requests" in report and REFUSAL in report


def test_failing_baseline_makes_every_gate_over_it_inconclusive(tmp_path, refuse):
    refuse("baseline")
    outcome = run_gate(_contract(tmp_path), tmp_path / "r.duckdb", report_dir=tmp_path)
    assert outcome.verdict.decision == VERDICT_INCONCLUSIVE
    assert {r.status for _, r in outcome.results} == {INCONCLUSIVE}
    assert all("baseline: " in r.summary for _, r in outcome.results)


def test_healthy_arms_are_judged_on_their_own_figures(tmp_path, refuse):
    refuse()
    outcome = run_gate(_contract(tmp_path), tmp_path / "r.duckdb", report_dir=tmp_path)
    assert _gate(outcome, "token_hash_equal:determinism").status == PASS
    assert "failed" not in _gate(outcome, "speedup:prefill_throughput").summary
    assert "## Failed requests" not in outcome.report_path.read_text(encoding="utf-8")


class _Rows:
    def __init__(self, rows: dict):
        self.rows = rows

    def requests(self, run_id, arm, workload=None):
        return [r for r in self.rows.get(arm, []) if workload is None or r["workload"] == workload]


def _rows(n: int, failed: int, workload: str = "w") -> list[dict]:
    return [{"workload": workload, "request_key": f"k{i}", "finish_reason": "abort" if i < failed else "length",
             "error": "refused" if i < failed else None} for i in range(n)]


@pytest.mark.parametrize("base_failed,cand_failed,expected", [
    (0, 0, PASS), (0, 1, FAIL), (1, 0, INCONCLUSIVE), (2, 2, INCONCLUSIVE), (1, 5, FAIL)])
def test_failure_rule_overrides_a_passing_check(base_failed, cand_failed, expected):
    ev = Evidence(_Rows({"baseline": _rows(10, base_failed), "candidate": _rows(10, cand_failed)}), "run")
    held = hold_to_failures(CheckResult(PASS, "ratio 1e10"), ev, ["w"])
    assert held.status == expected
    if expected != PASS:
        assert held.statistic["failed_requests"] == {"baseline": base_failed, "candidate": cand_failed}


def test_failures_in_other_workloads_do_not_touch_a_gate():
    ev = Evidence(_Rows({"baseline": _rows(4, 0, "a"), "candidate": _rows(4, 4, "b")}), "run")
    assert hold_to_failures(CheckResult(PASS, "ok"), ev, ["a"]).status == PASS


def test_task_item_of_a_failed_request_is_not_stored(tmp_path):
    with Store(tmp_path / "s.duckdb") as store:
        sink = StoreSink(store, "run", "candidate", "gsm8k", "all", 0, {}, lambda n: None)
        sink.request(RequestRecord(request_key="q1/seed=0", finish_reason="abort", error="refused"))
        sink.item(ItemOutcome(item_id="q1", passed={"correct": False}, seed=0), request_key="q1/seed=0")
        sink.request(RequestRecord(request_key="q2/seed=0", finish_reason="stop"))
        sink.item(ItemOutcome(item_id="q2", passed={"correct": True}, seed=0), request_key="q2/seed=0")
        assert [i["item_id"] for i in store.items("run", "candidate", "gsm8k")] == ["q2"]


@pytest.mark.parametrize("engine,workload,needed", [
    (", max_model_len: 4", "prefill_throughput", 65),
    (", max_model_len: 1", "determinism", 9),
])
def test_contract_whose_requests_cannot_fit_is_refused_before_loading(tmp_path, engine, workload, needed):
    gate_fakes.FakeEngine.opened.clear()
    path = _contract(tmp_path, engine)
    with pytest.raises(ContractError) as err:
        run_gate(path, tmp_path / "r.duckdb")
    assert f"workload {workload!r} needs requests of at least {needed} tokens" in str(err.value)
    assert gate_fakes.FakeEngine.opened == []
    assert not (tmp_path / "r.duckdb").exists()


def test_candidate_override_that_cannot_fit_exits_2_from_the_cli(tmp_path):
    path = _contract(tmp_path)
    path.write_text(path.read_text() + "arms:\n  candidate: {engine: {max_model_len: 4}}\n", encoding="utf-8")
    result = CliRunner().invoke(app, ["gate", "run", str(path), "--db", str(tmp_path / "r.duckdb"),
                                      "--no-progress"])
    assert result.exit_code == 2, result.output
    assert "arms.candidate.engine.max_model_len" in result.output
    assert "Traceback" not in result.output


def test_ppl_segment_longer_than_the_context_is_refused(tmp_path):
    gate_fakes.write_fake_contract(tmp_path)
    path = tmp_path / "fake.yaml"
    text = path.read_text().replace("engine: {backend: fake}", "engine: {backend: fake, max_model_len: 32}")
    path.write_text(text.replace("decode_throughput, input_len: 16, output_len: 8",
                                 "decode_throughput, input_len: 8, output_len: 8"), encoding="utf-8")
    with pytest.raises(ContractError, match="workload 'ppl' needs requests of at least 33 tokens"):
        run_gate(path, tmp_path / "r.duckdb")


def test_promote_still_possible(tmp_path, refuse):
    """The rule must not make a healthy, faster-or-equal candidate unpromotable."""
    refuse()
    path = _contract(tmp_path)
    path.write_text(path.read_text().replace("min_ratio: 1.05", "min_ratio: 0.5"), encoding="utf-8")
    outcome = run_gate(path, tmp_path / "r.duckdb", report_dir=tmp_path)
    assert outcome.verdict.decision == PROMOTE, [(g.id, r.summary) for g, r in outcome.results]


def test_contract_check_names_requests_that_cannot_fit(tmp_path):
    path = _contract(tmp_path, ", max_model_len: 4")
    result = CliRunner().invoke(app, ["contract", "check", str(path)])
    assert result.exit_code == 2
    assert "needs requests of at least 65 tokens" in result.output
