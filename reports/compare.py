"""A `bench compare` run (engines side by side under one endpoint load), rendered from the store.

    compare_summary(store, run_id) -> dict   the JSON that `onecat bench compare` writes
    render_compare(summary) -> str           its markdown: one table per workload, one row per engine

Both read only stored rows (runs, arm_outcomes, environment, metrics, requests), so any past
comparison can be rendered again with `onecat report RUN`.
"""
from __future__ import annotations

import datetime as dt
import json
from collections import defaultdict
from typing import Any

from onecat.results.store import Store

SHOWN = [("output_tok_s", "output tok/s", "{:.1f}"), ("request_throughput", "req/s", "{:.2f}"),
         ("ttft_p50_s", "TTFT p50 s", "{:.3f}"), ("ttft_p90_s", "TTFT p90 s", "{:.3f}"),
         ("tpot_p50_s", "TPOT p50 s", "{:.4f}"), ("itl_p90_s", "ITL p90 s", "{:.4f}"),
         ("e2e_p50_s", "e2e p50 s", "{:.2f}"), ("num_failed", "failed", "{:.0f}")]


def _utc_iso(when: dt.datetime) -> str:
    return when.replace(tzinfo=dt.timezone.utc).isoformat(timespec="seconds")


def _workload_figures(store: Store, run_id: str, label: str, workload_id: str) -> dict[str, Any]:
    """Each metric's mean over the workload's units (per-position figures left out), and the first error."""
    values: dict[str, list[float]] = defaultdict(list)
    for m in store.metrics(run_id, label, workload_id):
        if not json.loads(m["tags_json"] or "{}").get("position"):
            values[m["name"]].append(m["value"])
    figures: dict[str, Any] = {name: sum(v) / len(v) for name, v in values.items()}
    failed = sorted((r for r in store.requests(run_id, label, workload_id) if r["error"]),
                    key=lambda r: r["recorded_at"])
    if failed:
        figures["first_error"] = failed[0]["error"]
    return figures


def compare_summary(store: Store, run_id: str) -> dict[str, Any]:
    run = store.run(run_id)
    if run is None:
        raise LookupError(f"no run {run_id!r} in {store.path}")
    if run.get("kind") != "compare":
        raise ValueError(f"run {run_id} is a {run.get('kind')} run, not a `bench compare` run")
    spec = json.loads(run["contract_json"])
    settings = json.loads(run["arm_settings_json"] or "{}")
    environment = {e["arm"]: e for e in store.environment(run_id)}
    engines: dict[str, Any] = {}
    for outcome in sorted(store.arm_outcomes(run_id), key=lambda o: o["recorded_at"]):  # the order they ran in
        label = outcome["arm"]
        entry: dict[str, Any] = {"backend": settings[label]["backend"],
                                 "description": settings[label].get("description", "")}
        engines[label] = entry
        if outcome["status"] == "skipped":
            entry["skipped"] = outcome["error"]
            continue
        entry["open_s"] = outcome["open_s"]
        entry["info"] = json.loads(environment[label]["engine_info_json"] or "{}") if label in environment else {}
        entry["workloads"] = {w.get("name") or w["kind"]: _workload_figures(store, run_id, label,
                                                                            w.get("name") or w["kind"])
                              for w in spec["workloads"]}
        if outcome["status"] == "failed":
            entry["error"] = outcome["error"]
    machine = next(iter(environment.values()), {})
    return {"run_id": run_id, "name": spec["name"], "description": spec.get("description", ""),
            "model": spec["model"], "sampling": spec["sampling"], "seeds": spec["seeds"],
            "workloads": spec["workloads"], "engines": engines,
            "when": _utc_iso(run["finished_at"] or run["started_at"]),
            "machine": {"cpu": machine.get("cpu_model"), "python": machine.get("python_version")},
            "kind": "measured", "store": store.path}


def render_compare(summary: dict[str, Any]) -> str:
    lines = [f"# {summary['name']}", "", summary.get("description", ""), "",
             f"Measured {summary['when']} on {summary['machine']['cpu']}; model {summary['model']['source']}; "
             f"sampling {json.dumps(summary['sampling'])}.", ""]
    for w in summary["workloads"]:
        wid = w.get("name") or w["kind"]
        mode = f"concurrency {w['concurrency']}" if w.get("concurrency") else f"rate {w.get('request_rate')} req/s"
        lines += [f"## {wid}: {mode}, {w['num_requests']} requests, ~{w['input_len']} in / {w['output_len']} out", "",
                  "| engine | " + " | ".join(h for _, h, _ in SHOWN) + " |",
                  "|---|" + "---:|" * len(SHOWN)]
        for label, entry in summary["engines"].items():
            if "skipped" in entry:
                lines.append(f"| {label} | skipped: {entry['skipped'][:120]} |" + " |" * (len(SHOWN) - 1))
                continue
            vals = entry.get("workloads", {}).get(wid, {})
            cells = [fmt.format(vals[k]) if k in vals else "-" for k, _, fmt in SHOWN]
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += [f"_Run {summary['run_id']} in the results store `{summary['store']}`; query it with "
              "`onecat results query`._", ""]
    return "\n".join(lines)


def render_compare_report(store: Store, run_id: str) -> str:
    return render_compare(compare_summary(store, run_id))
