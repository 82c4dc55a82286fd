"""Results store: migrations, queries, export, and durability (kill -9 mid-run, then --resume)."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import gate_fakes
from onecat.gates.contract import load_contract
from onecat.gates.gate_run import ResumeError, build_schedule, gate_run_record, run_gate
from onecat.results.records import ItemOutcome, Metric, RequestRecord
from onecat.results.export import export_run
from onecat.results.schema import MIGRATIONS
from onecat.results.store import Store

HERE = Path(__file__).resolve().parent


def test_schema_is_versioned_and_reopen_is_idempotent(tmp_path):
    db = tmp_path / "r.duckdb"
    s = Store(db)
    assert s.schema_version() == len(MIGRATIONS)
    s.close()
    s = Store(db)
    assert s.schema_version() == len(MIGRATIONS)
    s.con.execute("INSERT INTO schema_version VALUES (999, NULL)")
    s.close()
    with pytest.raises(RuntimeError, match="newer than this onecat"):
        Store(db)


def test_rows_queries_and_export(tmp_path):
    contract = load_contract(gate_fakes.write_fake_contract(tmp_path))
    s = Store(tmp_path / "r.duckdb")
    arms = {a: contract.arm(a) for a in ("baseline", "candidate")}
    s.create_run(gate_run_record("run-1", contract, "x.yaml", arms, {"tiny_text": "ab"}, "e", "h", "0"))
    s.add_request("run-1", "baseline", "w", RequestRecord("a", token_sha256="t", finish_reason="stop"), "u")
    s.add_request("run-1", "baseline", "w", RequestRecord(request_key="a", token_sha256="t2"), "u")  # replaces
    s.add_item("run-1", "baseline", "w", ItemOutcome(item_id="i", seed=0, passed={"base": True, "plus": False}))
    s.add_metric("run-1", "baseline", "w", Metric("decode_tok_s", 5.0, "tok/s", key="bs=1", repeat=0), "u", 0)
    with pytest.raises(ValueError, match="measured"):
        s.add_metric("run-1", "baseline", "w", Metric("x", 1.0, "s", kind="guessed"))
    assert [r["token_sha256"] for r in s.requests("run-1")] == ["t2"]
    assert sorted((r["measure"], r["passed"]) for r in s.items("run-1")) == [("base", True), ("plus", False)]
    cols, rows = s.query("SELECT name, value, kind FROM metrics")
    assert cols == ["name", "value", "kind"] and rows == [("decode_tok_s", 5.0, "measured")]
    assert s.resolve_run_id("run") == "run-1" and s.resolve_run_id(None) == "run-1"
    run = s.run("run-1")
    assert run["contract_fingerprint"] == contract.fingerprint
    assert run["candidate_fingerprint"] == contract.arm("candidate").fingerprint
    assert json.loads(run["dataset_sha256_json"]) == {"tiny_text": "ab"}
    files = export_run(s, "run-1", tmp_path / "out", "json")
    data = json.loads((tmp_path / "out" / "run-1.requests.json").read_text())
    assert len(files) == 9 and data[0]["request_key"] == "a"
    export_run(s, "run-1", tmp_path / "csv", "csv")
    assert (tmp_path / "csv" / "run-1.item_outcomes.csv").read_text().count("\n") == 3


def test_schedule_interleaves_throughput_abab_a(tmp_path):
    contract = load_contract(gate_fakes.write_fake_contract(tmp_path))
    steps = [(s.arm[0], s.unit.key) for s in build_schedule(contract) if s.workload_id == "decode_throughput"]
    assert steps[:5] == [("b", "bs=1/rep=0"), ("c", "bs=1/rep=0"), ("b", "bs=1/rep=1"), ("c", "bs=1/rep=1"),
                         ("b", "bs=1/rep=2")]


CHILD = """
import sys
sys.path.insert(0, {tests!r})
import gate_fakes
from onecat.gates.gate_run import run_gate
run_gate({contract!r}, {db!r}, report_dir={out!r})
"""


def test_sigkill_mid_run_then_resume_keeps_finished_requests(tmp_path):
    contract = gate_fakes.write_fake_contract(tmp_path)
    db, log = tmp_path / "r.duckdb", tmp_path / "calls.log"
    env = dict(os.environ, FAKE_ENGINE_DELAY="0.05", FAKE_ENGINE_LOG=str(log))
    code = CHILD.format(tests=str(HERE), contract=str(contract), db=str(db), out=str(tmp_path))
    child = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.time() + 120
    while time.time() < deadline:
        if log.exists() and len(log.read_text().splitlines()) >= 20:
            break
        if child.poll() is not None:
            pytest.fail("child finished before it could be killed: " + child.stdout.read().decode()[-2000:])
        time.sleep(0.02)
    child.send_signal(signal.SIGKILL)
    child.wait(timeout=30)
    assert child.returncode == -signal.SIGKILL

    s = Store(db)
    (run_id, status), = s.query("SELECT run_id, status FROM runs")[1]
    assert status == "interrupted"  # killed: the next open for writing saw its writer gone
    done_before = s.done_units(run_id)
    kept = {(r["arm"], r["workload"], r["request_key"]): r["recorded_at"] for r in s.requests(run_id)
            if (r["arm"], r["workload"], r["unit_key"]) in done_before}
    s.close()
    total = len(build_schedule(load_contract(contract)))
    assert 0 < len(done_before) < total and kept

    calls_before = len(log.read_text().splitlines())
    os.environ["FAKE_ENGINE_LOG"] = str(log)
    try:
        outcome = run_gate(contract, db, resume=True, report_dir=tmp_path)
    finally:
        os.environ.pop("FAKE_ENGINE_LOG")
    assert outcome.run_id == run_id and outcome.steps_skipped == len(done_before)
    assert outcome.steps_run == total - len(done_before)
    s = Store(db)
    after = {(r["arm"], r["workload"], r["request_key"]): r["recorded_at"] for r in s.requests(run_id)}
    assert all(after[k] == t for k, t in kept.items())  # finished requests were not redone
    assert len(s.done_units(run_id)) == total and s.run(run_id)["status"] == "complete"
    # one row per segment and arm even though a unit may have been cut short mid-way
    (dups,), = s.query("SELECT count(*) FROM (SELECT arm, key FROM metrics WHERE name = 'segment_nll'"
                       " GROUP BY ALL HAVING count(*) > 1)")[1]
    assert dups == 0
    calls_resumed = len(log.read_text().splitlines()) - calls_before
    warmups = 4  # throughput warm-up: 2 batch sizes x 2 arms, redone in the new process
    assert calls_resumed <= total - len(done_before) + warmups
    s.close()
    with pytest.raises(ResumeError, match="no unfinished run"):
        run_gate(contract, db, resume=True, report_dir=tmp_path)


def test_results_cli_list_show_query_export_report(tmp_path):
    from typer.testing import CliRunner

    from onecat.cli.main import app

    contract = gate_fakes.write_fake_contract(tmp_path)
    db = tmp_path / "r.duckdb"
    runner = CliRunner()
    res = runner.invoke(app, ["gate", "run", str(contract), "--db", str(db), "--out", str(tmp_path / "rep"),
                              "--no-progress"])
    assert res.exit_code == 0, res.output  # the fake candidate passes every binding gate
    assert "PROMOTE" in res.output and "report:" in res.output
    listing = runner.invoke(app, ["results", "list", "--db", str(db)])
    assert listing.exit_code == 0 and "fake-gate" in listing.output
    show = runner.invoke(app, ["results", "show", "--db", str(db)])
    assert show.exit_code == 0 and "ppl_delta" in show.output
    q = runner.invoke(app, ["results", "query", "SELECT count(*) AS n FROM verdicts", "--db", str(db),
                            "--format", "json"])
    assert q.exit_code == 0 and json.loads(q.output) == [{"n": 1}]
    bad = runner.invoke(app, ["results", "query", "SELECT * FROM nope", "--db", str(db)])
    assert bad.exit_code == 2
    exp = runner.invoke(app, ["results", "export", "--db", str(db), "--format", "csv", "--out", str(tmp_path / "x")])
    assert exp.exit_code == 0 and len(list((tmp_path / "x").glob("*.csv"))) == 9
    rep = runner.invoke(app, ["report", "--db", str(db), "--out", str(tmp_path / "again.md")])
    assert rep.exit_code == 0 and "Verdict: PROMOTE" in (tmp_path / "again.md").read_text()
    missing = runner.invoke(app, ["results", "list", "--db", str(tmp_path / "none.duckdb")])
    assert missing.exit_code == 2
    # a failing candidate: the same contract with a PPL bound it cannot meet -> ROLLBACK, exit 1
    strict = tmp_path / "strict.yaml"
    strict.write_text(contract.read_text().replace("max_relative: 0.01", "max_relative: 0.00001"))
    res = runner.invoke(app, ["gate", "run", str(strict), "--db", str(db), "--out", str(tmp_path / "rep"),
                              "--no-progress"])
    assert res.exit_code == 1 and "ROLLBACK" in res.output, res.output


def _fake_variant(tmp_path, interleave=True):
    path = gate_fakes.write_fake_contract(tmp_path)
    text = path.read_text().replace(
        "workloads:\n", "workloads:\n  - {kind: prefill_throughput, input_len: 24, batch_sizes: [2], repeats: 3, "
                        "warmup: 0}\n", 1)
    text = text.replace("gates:\n", "gates:\n  - {check: speedup, workload: prefill_throughput, metric: prefill_tok_s,"
                                    " min_ratio: 1.5, min_observations: 3, informative: true}\n", 1)
    if not interleave:
        text = text.replace("seeds: [0, 1]", "seeds: [0, 1]\nexecution: {interleave: false}")
    path.write_text(text)
    return path


def test_arm_after_arm_execution_and_prefill_runner(tmp_path):
    gate_fakes.FakeEngine.opened.clear()
    outcome = run_gate(_fake_variant(tmp_path, interleave=False), tmp_path / "r.duckdb", report_dir=tmp_path)
    assert gate_fakes.FakeEngine.opened == ["baseline", "candidate"]
    s = Store(tmp_path / "r.duckdb")
    pos = s.query("SELECT arm, max(position), min(position) FROM units WHERE run_id = ? GROUP BY arm ORDER BY arm",
                  [outcome.run_id])[1]
    assert pos[0][1] < pos[1][2]  # every baseline unit ran before any candidate unit
    reps = s.query("SELECT arm, count(*) FROM metrics WHERE run_id = ? AND name = 'prefill_tok_s'"
                   " AND workload = 'prefill_throughput' GROUP BY arm"
                   " ORDER BY arm", [outcome.run_id])[1]
    assert reps == [("baseline", 4), ("candidate", 3)]  # A/B/A: one extra baseline repeat
    speed = {g.check: r for g, r in outcome.results}["speedup"]
    assert speed.status == "fail" and speed.statistic["estimate"] == pytest.approx(1.0)  # same fake speed
    assert outcome.verdict.decision == "PROMOTE"  # the speed gate is informative
    s.close()


def test_resume_refuses_a_changed_contract(tmp_path):
    path = gate_fakes.write_fake_contract(tmp_path)
    db = tmp_path / "r.duckdb"
    contract = load_contract(path)
    s = Store(db)
    arms = {a: contract.arm(a) for a in ("baseline", "candidate")}
    s.create_run(gate_run_record("r-old", contract, str(path), arms, {}, "e", "h", "0"))
    s.close()
    path.write_text(path.read_text().replace("max_tokens: 12", "max_tokens: 13"))
    with pytest.raises(ResumeError, match="no unfinished run"):
        run_gate(path, db, resume=True, report_dir=tmp_path)
    with pytest.raises(ResumeError, match="different contract"):
        run_gate(path, db, resume="r-old", report_dir=tmp_path)
