"""`onecat results history`: a contract's runs in time order, with verdicts, gate numbers and chosen metrics."""
from __future__ import annotations

import datetime as dt

import pytest
from typer.testing import CliRunner

from onecat.cli.main import app
from onecat.gates.checks.base import FAIL, INCONCLUSIVE, PASS, CheckResult
from onecat.gates.checks.ppl_delta import PplDelta
from onecat.gates.checks.speedup import Speedup
from onecat.reports.history import history_table, plot_series
from onecat.results.history import contract_history
from onecat.results.records import Metric, RunRecord
from onecat.results.store import Store

SPEED_GATE = Speedup.Config(workload="decode", min_ratio=1.2)
PPL_GATE = PplDelta.Config(max_relative=0.01)
# run id (deliberately not in time order), start minute, revision, verdict, speed estimate, decode tok/s per arm
RUNS = [("run-c", 0, "aaaaaaaaaaaa", "PROMOTE", 1.40, (10.0, 14.0)),
        ("run-a", 1, "bbbbbbbbbbbb", "INCONCLUSIVE", 1.22, (10.0, 12.2)),
        ("run-b", 2, "cccccccccccc-dirty", "ROLLBACK", 1.05, (10.0, 10.5))]


def _write_runs(store: Store) -> None:
    for run_id, minute, revision, verdict, estimate, (base, cand) in RUNS:
        store.create_run(RunRecord(run_id, "drift", "f" * 64, "{}", engine_revision=revision))
        store.con.execute("UPDATE runs SET started_at = ? WHERE run_id = ?",
                          [dt.datetime(2026, 1, 1, 12, minute), run_id])
        status = {"PROMOTE": PASS, "ROLLBACK": FAIL}.get(verdict, INCONCLUSIVE)
        store.add_check(run_id, 0, SPEED_GATE, CheckResult(status, "speed", {"estimate": estimate, "bound": 1.2}))
        store.add_check(run_id, 1, PPL_GATE, CheckResult(PASS, "ppl", {"estimate": 1e-4, "max_relative": 0.01}))
        for arm, value in (("baseline", base), ("candidate", cand)):
            for repeat, wobble in enumerate((-0.5, 0.5)):  # the history shows the mean over repeats
                store.add_metric(run_id, arm, "decode", Metric("decode_tok_s", value + wobble, "tok/s", key="bs=1",
                                                               repeat=repeat))
            store.add_metric(run_id, arm, "decode", Metric("ttft_p50_s", 0.1, "s", key="endpoint"))
            store.add_metric(run_id, arm, "decode", Metric("spec_accepted_per_position", 3.0, "tok",
                                                           key="endpoint", tags={"position": 0}))
        store.set_status(run_id, "complete")
        store.set_verdict(run_id, verdict, "test")
    store.create_run(RunRecord("other-run", "unrelated", "e" * 64, "{}"))


@pytest.fixture
def db(tmp_path):
    path = tmp_path / "h.duckdb"
    with Store(path) as store:
        _write_runs(store)
    return path


def test_history_lists_the_contracts_runs_in_time_order_with_verdicts_and_gate_numbers(db):
    with Store(db, read_only=True) as store:
        history = contract_history(store, "drift")
    assert [r.run_id for r in history.runs] == ["run-c", "run-a", "run-b"]
    assert [r.verdict for r in history.runs] == ["PROMOTE", "INCONCLUSIVE", "ROLLBACK"]
    assert [r.gates["speedup:decode"] for r in history.runs] == [("pass", 1.40), ("inconclusive", 1.22),
                                                                ("fail", 1.05)]
    assert history.gate_ids() == ["speedup:decode", "ppl_delta:ppl"]
    assert history.metrics == ["decode_tok_s"]  # by default, the metric the speed gate names
    assert history.runs[2].metrics == {("decode_tok_s", "bs=1", "baseline"): 10.0,
                                       ("decode_tok_s", "bs=1", "candidate"): 10.5}
    header, rows = history_table(history)
    assert header[:6] == ["run", "started (UTC)", "revision", "verdict", "speedup:decode", "ppl_delta:ppl"]
    assert rows[2][:5] == ["run-b", "2026-01-01 12:02:00", "cccccccccc-dirty", "ROLLBACK", "FAIL 1.05"]


def test_plot_draws_the_stored_means_per_run(db):
    with Store(db, read_only=True) as store:
        panels = plot_series(contract_history(store, "drift"))
    assert panels == {"decode_tok_s [bs=1]": {"baseline": [10.0, 10.0, 10.0], "candidate": [14.0, 12.2, 10.5]}}


def test_metric_option_chooses_the_series_and_positions_are_left_out(db):
    with Store(db, read_only=True) as store:
        history = contract_history(store, "drift", ["ttft_p50_s"])
        with pytest.raises(LookupError, match="no metric 'spec_accepted_per_position'"):
            contract_history(store, "drift", ["spec_accepted_per_position"])  # a per-position figure, no series
    assert history.series() == [("ttft_p50_s", "endpoint", "baseline"), ("ttft_p50_s", "endpoint", "candidate")]


def test_without_a_metric_the_plot_follows_the_gate_numbers(tmp_path):
    with Store(tmp_path / "g.duckdb") as store:
        store.create_run(RunRecord("only", "gates-only", "f" * 64, "{}"))
        store.add_check("only", 0, PPL_GATE, CheckResult(PASS, "ppl", {"estimate": 2e-3, "max_relative": 0.01}))
        assert plot_series(contract_history(store, "gates-only")) == {"ppl_delta:ppl": {"key number": [2e-3]}}


def test_cli_prints_the_table_and_writes_markdown_and_a_plot(db, tmp_path):
    import matplotlib.image

    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["results", "history", "drift", "--db", str(db), "--out", str(out)],
                                env={"COLUMNS": "250"})
    assert result.exit_code == 0, result.output
    assert "run-c" in result.output and "ROLLBACK" in result.output
    markdown, plot = out / "drift-history.md", out / "drift-history.png"
    text = markdown.read_text()
    assert "| run-b | 2026-01-01 12:02:00 | cccccccccc-dirty | ROLLBACK | FAIL 1.05 |" in text
    assert "![history](drift-history.png)" in text
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and matplotlib.image.imread(plot).ndim == 3


@pytest.mark.parametrize("args, message", [
    (["nope"], "no runs of contract 'nope'"),
    (["drift", "--metric", "bogus"], "no metric 'bogus'"),
])
def test_bad_contract_name_or_metric_is_a_usage_error(db, tmp_path, args, message):
    result = CliRunner().invoke(app, ["results", "history", *args, "--db", str(db), "--out", str(tmp_path)],
                                env={"COLUMNS": "250"})
    assert result.exit_code == 2
    assert message in result.output
    assert "drift" in result.output and ("decode_tok_s" in result.output or args == ["nope"])  # says what exists
    assert not list(tmp_path.glob("*history*"))
