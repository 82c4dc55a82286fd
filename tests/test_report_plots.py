"""Report plots: PNG files next to the markdown, linked from it, drawing exactly the stored numbers."""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
import gate_fakes  # noqa: E402 - registers the fake engine the contract names

from onecat.gates.gate_run import run_gate  # noqa: E402
from onecat.reports.markdown import write_report  # noqa: E402
from onecat.reports.plot_data import (AcceptancePlot, LatencyPlot, PplPlot, SpeedPlot, StopRatePlot,  # noqa: E402
                                      ThroughputPlot)
from onecat.reports.plots import plot_data  # noqa: E402
from onecat.results.records import ArmOutcome, Environment, Metric, RequestRecord, RunRecord  # noqa: E402
from onecat.results.store import Store  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def gate_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gate")
    outcome = run_gate(gate_fakes.write_fake_contract(tmp), tmp / "r.duckdb", report_dir=tmp / "reports")
    return tmp / "r.duckdb", outcome


def _linked_images(report: Path) -> list[Path]:
    links = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", report.read_text())
    assert all(not Path(link).is_absolute() for link in links), links
    return [report.parent / link for link in links]


def _assert_readable_png(path: Path) -> None:
    import matplotlib.image

    assert path.read_bytes()[:8] == PNG_MAGIC
    pixels = matplotlib.image.imread(path)
    assert pixels.ndim == 3 and pixels.shape[0] > 100 and pixels.shape[1] > 100


def test_gate_report_links_one_png_per_plot(gate_run):
    db, outcome = gate_run
    images = _linked_images(outcome.report_path)
    with Store(db, read_only=True) as store:
        kinds = [type(p) for p in plot_data(store, outcome.run_id)]
    assert kinds == [PplPlot, SpeedPlot, StopRatePlot]  # gate order, then health; the fake engine drafts nothing
    assert len(images) == len(kinds)
    for image in images:
        _assert_readable_png(image)
        assert image.parent.name == f"{outcome.run_id}-plots"
    assert "## Plots" in outcome.report_path.read_text()


def test_speed_plot_draws_the_stored_interleaved_ratios(gate_run):
    db, outcome = gate_run
    with Store(db, read_only=True) as store:
        speed, = [p for p in plot_data(store, outcome.run_id) if isinstance(p, SpeedPlot)]
        stored = {(m["arm"], m["key"], m["repeat"]): m["value"] for arm in ("baseline", "candidate")
                  for m in store.metrics(outcome.run_id, arm, "decode_throughput", "decode_tok_s")}
        check, = [c for c in store.checks(outcome.run_id) if c["check_name"] == "not_slower"]
    expected = []
    for (arm, key, r), value in sorted(stored.items()):
        if arm == "candidate":
            bracket = [stored[("baseline", key, i)] for i in (r, r + 1) if ("baseline", key, i) in stored]
            expected.append((f"{key} r{r}", value / np.mean(bracket)))
    assert speed.labels == [label for label, _ in expected]
    assert speed.ratios == pytest.approx([ratio for _, ratio in expected], rel=1e-12)
    statistic = json.loads(check["statistic_json"])
    assert (speed.bound, speed.estimate, speed.low, speed.high) == (0.5, statistic["estimate"], statistic["low"],
                                                                    statistic["high"])
    assert speed.status == check["status"] and speed.low <= speed.estimate <= speed.high


def test_ppl_plot_draws_the_stored_per_segment_deltas(gate_run):
    db, outcome = gate_run
    with Store(db, read_only=True) as store:
        ppl, = [p for p in plot_data(store, outcome.run_id) if isinstance(p, PplPlot)]
        nll = {(m["arm"], m["key"]): m["value"] for m in store.metrics(outcome.run_id, name="segment_nll")}
        tokens = {m["key"]: m["value"] for m in store.metrics(outcome.run_id, "baseline", name="segment_tokens")}
    assert len(ppl.segments) == 6 and ppl.segments == sorted(tokens, key=lambda k: int(k.rsplit("=", 1)[-1]))
    expected = [np.expm1((nll[("candidate", k)] - nll[("baseline", k)]) / tokens[k]) for k in ppl.segments]
    assert ppl.relative == pytest.approx(expected, rel=1e-9, abs=1e-15)
    assert ppl.bound == 0.01


def test_stop_rate_plot_counts_the_stored_requests(gate_run):
    db, outcome = gate_run
    with Store(db, read_only=True) as store:
        rates, = [p for p in plot_data(store, outcome.run_id) if isinstance(p, StopRatePlot)]
        rows = [r for r in store.requests(outcome.run_id) if r["natural_stop_eligible"] and not r["error"]]
    for (workload, arm), n, stop, capped in zip(rates.groups, rates.eligible, rates.natural_stop_rate,
                                                rates.capped_rate):
        group = [r for r in rows if (r["workload"], r["arm"]) == (workload, arm)]
        assert n == len(group) > 0
        assert stop == sum(bool(r["natural_stop"]) for r in group) / n
        assert capped == sum(bool(r["capped"]) for r in group) / n
    assert {a for _, a in rates.groups} == {"baseline", "candidate"}


def test_rerendering_replaces_the_plots_and_keeps_links_relative(gate_run, tmp_path):
    db, outcome = gate_run
    target = tmp_path / "elsewhere" / "report.md"
    stale = tmp_path / "elsewhere" / "report-plots" / "99-stale.png"
    stale.parent.mkdir(parents=True)
    stale.write_bytes(PNG_MAGIC)
    with Store(db, read_only=True) as store:
        write_report(store, outcome.run_id, target)
    images = _linked_images(target)
    assert not stale.exists() and sorted(images) == sorted(stale.parent.glob("*.png")) and len(images) == 3


def test_without_matplotlib_the_report_renders_and_says_why(gate_run, tmp_path, monkeypatch):
    db, outcome = gate_run
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    with Store(db, read_only=True) as store:
        path = write_report(store, outcome.run_id, tmp_path)
    text = path.read_text()
    assert "**Verdict:" in text and "No plots: matplotlib is not installed" in text
    assert not list(tmp_path.rglob("*.png"))


def _spec_run(store: Store) -> str:
    store.create_run(RunRecord("spec-run", "spec", "f" * 64, "{}"))
    per_request = {"baseline": [], "candidate": [(4, [3, 2, 1]), (6, [5, 3])]}  # (drafts, accepted per position)
    for arm, requests in per_request.items():
        for i, (drafts, accepted) in enumerate(requests):
            store.add_request("spec-run", arm, "gen", RequestRecord(f"r{i}", spec_num_drafts=drafts,
                                                                   spec_accepted_per_position=accepted))
    store.add_request("spec-run", "candidate", "gen", RequestRecord("failed", spec_num_drafts=9,
                                                                    spec_accepted_per_position=[9], error="boom"))
    return "spec-run"


def test_acceptance_per_draft_position_comes_from_the_stored_counts():
    with Store(":memory:") as store:
        plot, = [p for p in plot_data(store, _spec_run(store)) if isinstance(p, AcceptancePlot)]
    assert (plot.workload, plot.arms, plot.drafts) == ("gen", ["candidate"], [10])  # a failed request is no evidence
    assert plot.rate_per_position == [[0.8, 0.5, 0.1]]


def _compare_run(store: Store) -> str:
    spec = {"name": "peers", "model": {"source": "fake:tiny"}, "sampling": {}, "seeds": [0],
            "workloads": [{"kind": "endpoint", "name": f"c{c}", "concurrency": c, "num_requests": 4, "input_len": 8,
                           "output_len": 4} for c in (1, 4)]}
    store.create_run(RunRecord("cmp-run", "peers", "c" * 64, json.dumps(spec), kind="compare",
                               arm_settings={"a": {"backend": "fake"}, "b": {"backend": "fake"}}))
    for engine, speed in (("a", 10.0), ("b", 30.0)):
        store.add_environment("cmp-run", engine, Environment(cpu_model="test"))
        store.add_arm_outcome("cmp-run", engine, ArmOutcome("ran", open_s=0.1))
        for c in (1, 4):
            figures = {"output_tok_s": speed * c, "ttft_p50_s": 0.1 * c, "ttft_p99_s": 0.3 * c,
                       "tpot_p50_s": 0.01 * c, "tpot_p99_s": 0.02 * c}
            for name, value in figures.items():
                store.add_metric("cmp-run", engine, f"c{c}", Metric(name, value, "x", key="endpoint", repeat=0))
    store.set_status("cmp-run", "complete")
    return "cmp-run"


def test_compare_plots_draw_throughput_vs_concurrency_and_latency_percentiles(tmp_path):
    with Store(tmp_path / "c.duckdb") as store:
        run_id = _compare_run(store)
        plots = plot_data(store, run_id)
        path = write_report(store, run_id, tmp_path / "out")
    throughput, *latency = plots
    assert isinstance(throughput, ThroughputPlot) and throughput.load_label == "concurrency"
    assert throughput.engines == {"a": [(1.0, 10.0), (4.0, 40.0)], "b": [(1.0, 30.0), (4.0, 120.0)]}
    assert [type(p) for p in latency] == [LatencyPlot, LatencyPlot]
    assert latency[1].workload == "c4" and latency[1].percentiles == [50, 99]
    assert latency[1].ttft_s["a"] == pytest.approx([0.4, 1.2]) and latency[1].tpot_s["b"] == pytest.approx([0.04, 0.08])
    images = _linked_images(path)
    assert len(images) == 3
    for image in images:
        _assert_readable_png(image)
