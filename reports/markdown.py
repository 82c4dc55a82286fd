"""Markdown report of one run, rendered only from the store (so any past run can be re-rendered).

    write_report(store, run_id, out_dir=None) -> Path   (default .onecat/reports/<run_id>.md); its plots
                                                        go to <report stem>-plots/ next to it (plots.py)
    render_report(store, run_id, plots=None) -> str     (a `bench compare` run: reports/compare.py)
"""
from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any, Optional

import numpy as np

from onecat.reports.compare import render_compare_report
from onecat.reports.plots import Plots, write_plots
from onecat.results.paths import DEFAULT_REPORT_DIR
from onecat.results.records import FAILED_FINISH_REASONS
from onecat.results.store import Store


def _fmt(v: Any) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def markdown_table(header: list[str], rows: list[list[Any]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(_fmt(c).replace("|", "\\|") for c in r) + " |" for r in rows]
    return out


def plots_section(plots: Plots, report_folder: Path) -> list[str]:
    """The report's plots as relative image links (the report and its plot folder move together)."""
    lines = ["", "## Plots"]
    for title, path in plots.files:
        lines += ["", f"![{title}]({path.relative_to(report_folder).as_posix()})"]
    if plots.note:
        lines += ["", f"_No plots: {plots.note}._" if not plots.files else f"_{plots.note}._"]
    return lines


def _reused_evidence(store: Store, run_id: str) -> str:
    """Which workloads' rows an arm copied from an earlier run instead of generating them (gates/baseline_reuse.py)."""
    notes = []
    for outcome in store.arm_outcomes(run_id):
        for workload, source in sorted(json.loads(outcome.get("reused_evidence_json") or "{}").items()):
            notes.append(f"{outcome['arm']} {workload} reused from run {source['run_id']} ({source['arm']})")
    return "; ".join(notes) or "none"


def render_report(store: Store, run_id: str, plots: Optional[Plots] = None, report_folder: Path = Path(".")) -> str:
    """The markdown; `plots` (files under `report_folder`) adds a Plots section linking them."""
    run = store.run(run_id)
    if run is None:
        raise LookupError(f"no run {run_id!r} in {store.path}")
    figures = plots_section(plots, report_folder) if plots is not None else []
    if run.get("kind") == "compare":
        return render_compare_report(store, run_id) + "\n".join(figures)
    verdict = store.verdict(run_id)
    lines = [f"# Gate report: {run['contract_name']}", ""]
    v = verdict["verdict"] if verdict else "(none yet)"
    lines += [f"**Verdict: {v}**" + (f" — {verdict['reason']}" if verdict else ""), ""]
    lines += markdown_table(["field", "value"], [
        ["run", run_id], ["status", run["status"]], ["started (UTC)", run["started_at"]],
        ["finished (UTC)", run["finished_at"]], ["contract fingerprint", run["contract_fingerprint"]],
        ["baseline arm fingerprint", run["baseline_fingerprint"]],
        ["candidate arm fingerprint", run["candidate_fingerprint"]],
        ["engine revision", run["engine_revision"]], ["harness revision", run["harness_revision"]],
        *[[f"{a} engine code", c["label"]] for a in ("baseline", "candidate")
          if (c := (json.loads(run["arm_settings_json"] or "{}").get(a) or {}).get("code"))],
        ["datasets (sha256)", ", ".join(f"{k}={v[:12]}…" for k, v in json.loads(run["dataset_sha256_json"] or "{}").items())
         or "–"], ["evidence reused (--reuse-baseline)", _reused_evidence(store, run_id)]])
    lines += ["", "## Gates", ""]
    lines += markdown_table(["gate", "status", "binding", "summary"],
                    [[c["gate_id"], c["status"].upper(), "no" if c["informative"] else "yes", c["summary"]]
                     for c in store.checks(run_id)])
    lines += figures
    arms = json.loads(run["arm_settings_json"] or "{}")
    lines += ["", "## Arms (effective settings)", ""]
    keys = sorted({f"{sec}.{k}" for a in arms.values() for sec in ("model", "engine") for k in (a.get(sec) or {})})
    rows = []
    for k in keys:
        sec, name = k.split(".", 1)
        vals = [json.dumps((arms.get(a, {}).get(sec) or {}).get(name)) for a in ("baseline", "candidate")]
        rows.append([k + (" **(differs)**" if vals[0] != vals[1] else ""), *vals])
    rows.append(["speculative", *[json.dumps(arms.get(a, {}).get("speculative")) for a in ("baseline", "candidate")]])
    lines += markdown_table(["setting", "baseline", "candidate"], rows)
    env = store.environment(run_id)
    if env:
        lines += ["", "## Environment", ""]
        cols = ["arm", "cpu_model", "cpu_threads", "torch_threads", "gpu_name", "gpu_count", "gpu_driver",
                "torch_version", "cuda_version", "device", "kv_cache_dtype", "attention_backend", "cuda_graph",
                "prefix_caching"]
        lines += markdown_table(cols, [[e.get(c) for c in cols] for e in env])
    lines += ["", "## Metrics (measured; mean ± sd over repeats)", ""]
    agg: dict = defaultdict(list)
    units: dict = {}
    for arm in ("baseline", "candidate"):
        for m in store.metrics(run_id, arm):
            if m["name"].startswith("segment_"):
                continue
            agg[(m["workload"], m["name"], m["key"], m["kind"], arm)].append(m["value"])
            units[(m["workload"], m["name"])] = m["unit"]
    rows = []
    for (wl, name, key, kind) in sorted({k[:4] for k in agg}):
        cells = []
        for arm in ("baseline", "candidate"):
            vals = agg.get((wl, name, key, kind, arm), [])
            cells.append(f"{np.mean(vals):.4g} ± {np.std(vals):.2g} (n={len(vals)})" if vals else "–")
        rows.append([wl, name, key, units[(wl, name)], kind, *cells])
    lines += markdown_table(["workload", "metric", "key", "unit", "kind", "baseline", "candidate"], rows) if rows else ["(none)"]
    ppl_rows = []
    for arm in ("baseline", "candidate"):
        by_wl: dict = defaultdict(lambda: [0.0, 0.0])
        for m in store.metrics(run_id, arm):
            if m["name"] == "segment_nll":
                by_wl[m["workload"]][0] += m["value"]
            elif m["name"] == "segment_tokens":
                by_wl[m["workload"]][1] += m["value"]
        for wl, (nll, n) in by_wl.items():
            ppl_rows.append([wl, arm, int(n), float(np.exp(nll / n)) if n else None])
    if ppl_rows:
        lines += ["", "## Perplexity", ""] + markdown_table(["workload", "arm", "tokens", "ppl"], ppl_rows)
    lines += ["", "## Generation health", ""]
    cols, rows = store.query(
        "SELECT workload, arm, count(*) AS requests, sum(CASE WHEN natural_stop_eligible THEN 1 ELSE 0 END) AS eligible,"
        " sum(CASE WHEN natural_stop_eligible AND natural_stop THEN 1 ELSE 0 END) AS natural_stops,"
        " sum(CASE WHEN natural_stop_eligible AND capped THEN 1 ELSE 0 END) AS capped,"
        " sum(CASE WHEN repetition_loop THEN 1 ELSE 0 END) AS loops, sum(replacement_chars) AS u_fffd,"
        " sum(CASE WHEN error IS NOT NULL THEN 1 ELSE 0 END) AS errors"
        " FROM requests WHERE run_id = ? GROUP BY workload, arm ORDER BY workload, arm", [run_id])
    lines += markdown_table(cols, [list(r) for r in rows]) if rows else ["(no generations)"]
    lines += _failed_requests_section(store, run_id)
    cols, rows = store.query("SELECT workload, arm, measure, count(*) AS n, avg(CAST(passed AS INTEGER)) AS score"
                             " FROM item_outcomes WHERE run_id = ? GROUP BY ALL ORDER BY ALL", [run_id])
    if rows:
        lines += ["", "## Task scores", ""] + markdown_table(cols, [list(r) for r in rows])
    lines += ["", f"_Rendered from the results store `{store.path}`; query it with `onecat results query`._", ""]
    return "\n".join(lines)


def _failed_requests_section(store: Store, run_id: str) -> list[str]:
    """Every failed request, counted per workload and arm with its distinct errors: none of them is
    evidence, and a binding gate over their workload cannot pass."""
    cols, rows = store.query(
        "SELECT workload, arm, count(*) AS failed, count(DISTINCT coalesce(error, finish_reason)) AS kinds,"
        " min(request_key) AS first_request, any_value(coalesce(error, 'finish_reason=' || finish_reason)) AS error"
        " FROM requests WHERE run_id = ? AND (error IS NOT NULL OR list_contains(?, finish_reason))"
        " GROUP BY workload, arm ORDER BY workload, arm", [run_id, list(FAILED_FINISH_REASONS)])
    if not rows:
        return []
    shown = [[*r[:5], str(r[5])[:300]] for r in rows]
    return (["", "## Failed requests", "",
             "Failed requests contribute no throughput, latency or task figure; a binding gate over a workload "
             "with failed requests is FAIL (candidate failed more) or INCONCLUSIVE (the baseline failed).", ""]
            + markdown_table(list(cols), shown))


def write_report(store: Store, run_id: str, out_dir: Optional[str | Path] = None) -> Path:
    path = Path(out_dir or DEFAULT_REPORT_DIR)
    if path.suffix == ".md":
        target = path
    else:
        target = path / f"{run_id}.md"
    target.parent.mkdir(parents=True, exist_ok=True)
    plots = write_plots(store, run_id, target.parent / f"{target.stem}-plots")
    target.write_text(render_report(store, run_id, plots, target.parent), encoding="utf-8")
    return target
