"""`onecat bench compare` writes one run of kind "compare" into the DuckDB store (engine label = arm), and
its JSON and markdown are rendered from those rows; `results list/query` and `report` see the run.
CPU only, no peer servers: the fake engine, and an endpoint runner replaced by one that writes rows."""
import json
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).parent))
import gate_fakes  # noqa: E402 - registers the fake engine

from onecat.cli.main import app  # noqa: E402
from onecat.gates.registry import register_engine  # noqa: E402
from onecat.gates.runners.endpoint import EndpointRunner  # noqa: E402
from onecat.results.records import Metric, RequestRecord  # noqa: E402
from onecat.results.store import Store  # noqa: E402

SPEC = """
name: fake-peers
description: two fake engines and one that is not installed
model: {source: "fake:tiny"}
sampling: {temperature: 0.0, max_tokens: 8}
seeds: [0]
engines:
  slow: {backend: fake, description: "fake engine, 10 tok/s"}
  fast: {backend: fake, description: "fake engine, 30 tok/s"}
  absent: {backend: fake_absent}
workloads:
  - {kind: endpoint, name: streams-2, input_len: 8, output_len: 4, num_requests: 2, concurrency: 2}
"""
SPEED = {"slow": 10.0, "fast": 30.0}


@register_engine("fake_absent")
class AbsentEngine(gate_fakes.FakeEngine):
    @classmethod
    def check(cls, arm):
        return ["fake_absent is not installed here"]


def _fake_endpoint_unit(self, engine, workload, sampling, unit, sink):
    """What the endpoint runner stores for a unit, without a server: requests and aggregate metrics."""
    label = engine.arm.name
    for i in range(workload.num_requests):
        failed = label == "fast" and i == 1
        sink.request(RequestRecord(f"{unit.key}/req={i}", seed=unit.seed, repeat=unit.repeat,
                                   num_completion_tokens=0 if failed else workload.output_len,
                                   finish_reason="error" if failed else "length",
                                   error="HTTP 503: overloaded" if failed else None))
    sink.metric(Metric("output_tok_s", SPEED[label], "tok/s", key="endpoint", repeat=unit.repeat, seed=unit.seed))
    sink.metric(Metric("num_failed", float(label == "fast"), "req", key="endpoint", repeat=unit.repeat))
    sink.metric(Metric("spec_accepted_per_position", 99.0, "tok", key="endpoint", tags={"position": 1}))


@pytest.fixture
def compare_run(tmp_path, monkeypatch):
    monkeypatch.setattr(EndpointRunner, "run_unit", _fake_endpoint_unit)
    spec = tmp_path / "peers.yaml"
    spec.write_text(SPEC)
    db, out = tmp_path / "r.duckdb", tmp_path / "cmp"
    res = CliRunner().invoke(app, ["bench", "compare", str(spec), "--db", str(db), "--out", str(out)])
    assert res.exit_code == 0, res.output
    summary, = [json.loads(p.read_text()) for p in out.glob("*.json")]
    return db, out, summary, res.output


def test_compare_rows_land_in_the_store(compare_run):
    db, out, summary, _ = compare_run
    with Store(db, read_only=True) as store:
        run = store.run(summary["run_id"])
        assert (run["kind"], run["contract_name"], run["status"]) == ("compare", "fake-peers", "complete")
        assert {e["arm"] for e in store.environment(run["run_id"])} == {"slow", "fast", "absent"}
        outcomes = {o["arm"]: (o["status"], o["error"]) for o in store.arm_outcomes(run["run_id"])}
        assert outcomes == {"slow": ("ran", None), "fast": ("ran", None),
                            "absent": ("skipped", "fake_absent is not installed here")}
        assert len(store.requests(run["run_id"], "fast", "streams-2")) == 2
        assert {(u[0], u[1]) for u in store.done_units(run["run_id"])} == {("slow", "streams-2"),
                                                                          ("fast", "streams-2")}


def test_json_and_markdown_are_rendered_from_the_stored_run(compare_run):
    db, out, summary, output = compare_run
    engines = summary["engines"]
    assert list(engines) == ["slow", "fast", "absent"]  # the order they ran in
    assert engines["slow"]["workloads"]["streams-2"] == {"output_tok_s": 10.0, "num_failed": 0.0}
    assert engines["fast"]["workloads"]["streams-2"]["first_error"] == "HTTP 503: overloaded"
    assert {k: v for k, v in engines["absent"].items() if k != "load_1min_at_start"} == {
        "backend": "fake_absent", "description": "", "status": "skipped", "skipped": "fake_absent is not installed here"}
    assert summary["failed"] == [] and engines["slow"]["status"] == engines["fast"]["status"] == "ran"
    assert engines["fast"]["info"]["engine"] == "fake" and engines["fast"]["open_s"] >= 0
    assert summary["workloads"][0]["name"] == "streams-2" and summary["kind"] == "measured"
    markdown, = [p.read_text() for p in out.glob("*.md")]
    assert "| slow | 10.0 |" in markdown and "| fast | 30.0 |" in markdown
    assert "| absent | skipped: fake_absent is not installed here |" in markdown
    assert "| slow | 10.0 |" in output  # printed too
    linked = [line[line.index("](") + 2:-1] for line in markdown.splitlines() if line.startswith("![")]
    assert "## Plots" in markdown and linked, markdown  # throughput vs load, drawn from the stored run
    for rel in linked:
        assert (out / rel).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_results_list_query_and_report_see_the_compare_run(compare_run, tmp_path):
    db, _, summary, _ = compare_run
    runner = CliRunner()
    listing = runner.invoke(app, ["results", "list", "--db", str(db)], env={"COLUMNS": "200"})
    assert listing.exit_code == 0, listing.output
    assert f"{summary['run_id']} │ fake-peers (compare) │ complete" in listing.output
    query = runner.invoke(app, ["results", "query", "SELECT arm, value FROM metrics WHERE run_id = "
                                f"'{summary['run_id']}' AND name = 'output_tok_s' ORDER BY arm", "--db", str(db),
                                "--format", "json"])
    assert query.exit_code == 0 and json.loads(query.output) == [{"arm": "fast", "value": 30.0},
                                                                 {"arm": "slow", "value": 10.0}]
    show = runner.invoke(app, ["results", "show", summary["run_id"], "--db", str(db)], env={"COLUMNS": "200"})
    assert show.exit_code == 0 and "fake_absent is not installed here" in show.output
    assert "fast       streams-2                2 requests" in show.output
    report = runner.invoke(app, ["report", summary["run_id"], "--db", str(db), "--out", str(tmp_path / "r.md")])
    assert report.exit_code == 0 and "| fast | 30.0 |" in (tmp_path / "r.md").read_text()


def test_bad_only_label_and_unknown_backend_are_refused(tmp_path):
    spec = tmp_path / "peers.yaml"
    spec.write_text(SPEC)
    runner = CliRunner()
    res = runner.invoke(app, ["bench", "compare", str(spec), "--db", str(tmp_path / "r.duckdb"), "--only", "nope"])
    assert res.exit_code == 2 and "no such engine" in res.output
    spec.write_text(SPEC.replace("backend: fake_absent", "backend: no_such_backend"))
    res = runner.invoke(app, ["bench", "compare", str(spec), "--db", str(tmp_path / "r.duckdb")])
    assert res.exit_code == 2 and "unknown engine backend 'no_such_backend'" in res.output
    assert not (tmp_path / "r.duckdb").exists()  # refused before anything was written


def test_no_engine_that_could_run_exits_4(tmp_path, monkeypatch):
    monkeypatch.setattr(EndpointRunner, "run_unit", _fake_endpoint_unit)
    spec = tmp_path / "peers.yaml"
    spec.write_text(SPEC)
    res = CliRunner().invoke(app, ["bench", "compare", str(spec), "--only", "absent", "--db",
                                   str(tmp_path / "r.duckdb"), "--out", str(tmp_path / "cmp")])
    assert res.exit_code == 4 and "skipped" in res.output
