"""gate run --reuse-baseline: a second run of the same contract copies the baseline's deterministic evidence
(no baseline generation or scoring runs for those workloads), measures speed fresh, and reaches the same
verdict; a changed baseline setting, sampled decoding or another environment class reuses nothing."""
import json
from collections import Counter
from pathlib import Path

import pytest

import gate_fakes
from onecat.gates import baseline_reuse, registry
from onecat.gates.gate_run import ResumeError, run_gate
from onecat.results.store import Store

DETERMINISTIC = {"ppl", "determinism"}


@pytest.fixture
def runner_calls(monkeypatch):
    """(arm, workload) -> how many units a runner ran: generation or scoring that really happened."""
    registry.load_plugins()
    calls: Counter = Counter()
    for kind in ("ppl", "determinism", "decode_throughput"):
        cls = registry.RUNNERS[kind]
        original = cls.run_unit

        def counting(self, engine, workload, sampling, unit, sink, _original=original):
            calls[(sink.arm, workload.id)] += 1
            return _original(self, engine, workload, sampling, unit, sink)

        monkeypatch.setattr(cls, "run_unit", counting)
    return calls


@pytest.fixture
def engine_log(tmp_path, monkeypatch):
    log = tmp_path / "engine.log"
    monkeypatch.setenv("FAKE_ENGINE_LOG", str(log))
    return lambda: Counter(tuple(line.split()[:2]) for line in log.read_text().splitlines()) if log.exists() \
        else Counter()


def _gate(contract, db, **kwargs):
    """run_gate with its reports next to the test's store, not in the checkout's .onecat/."""
    return run_gate(contract, db, report_dir=Path(db).parent / "reports", **kwargs)


def _contract(tmp_path, sampling="{temperature: 0.0, max_tokens: 12}", baseline_arm=""):
    path = gate_fakes.write_fake_contract(tmp_path)
    text = path.read_text().replace("sampling: {temperature: 0.0, max_tokens: 12}", f"sampling: {sampling}")
    if baseline_arm:
        text = text.replace("arms:\n", f"arms:\n  baseline: {baseline_arm}\n")
    path.write_text(text)
    return path


def _baseline_rows(store, run_id):
    hashes = {(r["workload"], r["request_key"]): r["token_sha256"] for r in store.requests(run_id, "baseline")
              if r["workload"] == "determinism"}
    nll = {m["key"]: m["value"] for m in store.metrics(run_id, "baseline", "ppl", "segment_nll")}
    return hashes, nll


def test_second_run_reuses_deterministic_baseline_evidence(tmp_path, runner_calls, engine_log):
    db, contract = tmp_path / "r.duckdb", _contract(tmp_path)
    first = _gate(contract, db)
    calls_first, engine_first = dict(runner_calls), engine_log()
    runner_calls.clear()
    (tmp_path / "engine.log").unlink()
    second = _gate(contract, db, reuse_baseline=True)

    for workload in DETERMINISTIC:  # no baseline generation or scoring ran for the reusable workloads
        assert calls_first[("baseline", workload)] > 0
        assert runner_calls[("baseline", workload)] == 0
        assert runner_calls[("candidate", workload)] == calls_first[("candidate", workload)]
    assert engine_first[("baseline", "score")] > 0 and engine_log()[("baseline", "score")] == 0
    # speed is measured fresh and interleaved, on both arms
    assert runner_calls[("baseline", "decode_throughput")] == calls_first[("baseline", "decode_throughput")] > 0
    assert runner_calls[("candidate", "decode_throughput")] == calls_first[("candidate", "decode_throughput")]

    assert second.verdict.decision == first.verdict.decision
    assert [r.status for _, r in second.results] == [r.status for _, r in first.results]
    with Store(db, read_only=True) as store:
        assert _baseline_rows(store, second.run_id) == _baseline_rows(store, first.run_id)
        assert {e["arm"] for e in store.environment(second.run_id)} == {"baseline", "candidate"}
        outcome = {o["arm"]: o for o in store.arm_outcomes(second.run_id)}
        reused = json.loads(outcome["baseline"]["reused_evidence_json"])
        assert reused == {w: {"run_id": first.run_id, "arm": "baseline"} for w in DETERMINISTIC}
        assert json.loads(outcome["candidate"]["reused_evidence_json"]) == {}
        env_class = json.loads(outcome["baseline"]["environment_class_json"])
        assert set(env_class) == {"device", "device_name", "torch_version", "engine_code"}
        throughput = store.metrics(second.run_id, "baseline", "decode_throughput")
        assert throughput and all(m["recorded_at"] > store.run(first.run_id)["finished_at"] for m in throughput)
    report = second.report_path.read_text()
    assert first.run_id in report and "reused" in report


def test_a_third_run_reuses_from_a_run_that_itself_reused(tmp_path, runner_calls):
    db, contract = tmp_path / "r.duckdb", _contract(tmp_path)
    _gate(contract, db)
    second = _gate(contract, db, reuse_baseline=True)
    runner_calls.clear()
    third = _gate(contract, db, reuse_baseline=True)
    assert all(runner_calls[("baseline", w)] == 0 for w in DETERMINISTIC)
    with Store(db, read_only=True) as store:
        assert _baseline_rows(store, third.run_id) == _baseline_rows(store, second.run_id)
        reused = json.loads(store.arm_outcomes(third.run_id)[0]["reused_evidence_json"])
    assert {v["run_id"] for v in reused.values()} == {second.run_id}  # the newest match


def test_changed_baseline_setting_reuses_nothing(tmp_path, runner_calls):
    db = tmp_path / "r.duckdb"
    _gate(_contract(tmp_path), db)
    runner_calls.clear()
    changed = _gate(_contract(tmp_path, baseline_arm="{engine: {max_num_seqs: 7}}"), db, reuse_baseline=True)
    assert all(runner_calls[("baseline", w)] > 0 for w in DETERMINISTIC)
    assert any("no earlier complete run" in w for w in changed.warnings)
    with Store(db, read_only=True) as store:
        assert json.loads(store.arm_outcomes(changed.run_id)[0]["reused_evidence_json"]) == {}


def test_sampled_decoding_regenerates_generations(tmp_path, runner_calls):
    db, contract = tmp_path / "r.duckdb", _contract(tmp_path, sampling="{temperature: 0.7, max_tokens: 12}")
    _gate(contract, db)
    runner_calls.clear()
    _gate(contract, db, reuse_baseline=True)
    assert runner_calls[("baseline", "determinism")] > 0  # sampled generations: never reused
    assert runner_calls[("baseline", "ppl")] == 0  # scoring does not sample: still reused


def test_another_environment_class_reuses_nothing(tmp_path, runner_calls, monkeypatch):
    db, contract = tmp_path / "r.duckdb", _contract(tmp_path)
    _gate(contract, db)
    runner_calls.clear()
    monkeypatch.setattr(baseline_reuse, "engine_code", lambda: "another-engine-commit")
    _gate(contract, db, reuse_baseline=True)
    assert all(runner_calls[("baseline", w)] > 0 for w in DETERMINISTIC)


def test_reuse_is_decided_when_a_run_starts(tmp_path):
    with pytest.raises(ResumeError, match="--reuse-baseline decides what to copy when a run starts"):
        _gate(_contract(tmp_path), tmp_path / "r.duckdb", resume=True, reuse_baseline=True)


def test_each_runner_says_whether_its_evidence_is_deterministic():
    from onecat.gates.contract import SamplingSpec

    registry.load_plugins()
    greedy, sampled = SamplingSpec(temperature=0.0), SamplingSpec(temperature=0.8)
    decide = {kind: (cls().deterministic_evidence(None, greedy), cls().deterministic_evidence(None, sampled))
              for kind, cls in registry.RUNNERS.items()}
    assert decide["ppl"] == (True, True)
    for kind in ("determinism", "gsm8k", "humaneval_plus", "mbpp_plus", "structured_output"):
        assert decide[kind] == (True, False), kind
    for kind in ("decode_throughput", "prefill_throughput", "endpoint"):
        assert decide[kind] == (False, False), kind
