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
from typing import Any, Optional

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


def _isa_used(info: dict[str, Any]) -> Optional[dict[str, Any]]:
    """What the engine said it ran on: a peer's isa_used, the in-process onecat engine's cpu_isa."""
    if info.get("isa_used"):
        return info["isa_used"]
    return {"source": "onecat info", **info["cpu_isa"]} if info.get("cpu_isa") else None


def _machine(environment: dict[str, dict]) -> dict[str, Any]:
    """The machine of the run: the record every engine's environment row carries (label, CPU, ISA flags), or
    for runs stored before it, the CPU model of the first row."""
    first = next(iter(environment.values()), {})
    recorded = json.loads(first.get("engine_info_json") or "{}").get("machine") if first else None
    return {**(recorded or {"cpu": first.get("cpu_model")}), "python": first.get("python_version")}


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
        info = json.loads(environment[label]["engine_info_json"] or "{}") if label in environment else {}
        if "load_1min_at_start" in info:
            entry["load_1min_at_start"] = info["load_1min_at_start"]
        if outcome["status"] == "skipped":
            entry.update(status="skipped", skipped=outcome["error"])
            continue
        if outcome["status"] == "failed":  # a dead engine: its cause and last output, never its figures
            entry.update(status="FAILED", failure=info.get("failure") or {"cause": outcome["error"]})
        else:
            entry["status"] = "ran"
        entry["open_s"] = outcome["open_s"]
        entry["info"] = {k: v for k, v in info.items() if k not in ("machine", "failure")}
        entry["isa_used"] = _isa_used(info)
        if outcome["status"] == "ran":
            entry["workloads"] = {w.get("name") or w["kind"]: _workload_figures(store, run_id, label,
                                                                                w.get("name") or w["kind"])
                                  for w in spec["workloads"]}
    return {"run_id": run_id, "name": spec["name"], "description": spec.get("description", ""),
            "model": spec["model"], "sampling": spec["sampling"], "seeds": spec["seeds"],
            "workloads": spec["workloads"], "engines": engines,
            "failed": [label for label, e in engines.items() if e["status"] == "FAILED"],
            "when": _utc_iso(run["finished_at"] or run["started_at"]),
            "machine": _machine(environment), "kind": "measured", "store": store.path}


def _cell(text: Any) -> str:
    """Text that stays in one markdown table cell."""
    return str(text).replace("|", "\\|").replace("\n", " ")


def _isa_cell(isa: Optional[dict[str, Any]]) -> str:
    if not isa:
        return "-"
    if isa.get("error"):
        return _cell(f"unknown ({isa['error'][:100]})")
    parts = [" ".join(isa.get("features") or []),
             "weights in " + ", ".join(isa["model_buffers"]) if isa.get("model_buffers") else "",
             f"torch {isa['torch_cpu_capability']}" if isa.get("torch_cpu_capability") else "",
             f"oneDNN {isa['onednn_isa']}" if isa.get("onednn_isa") else "",
             f"CPU ops {isa['cpu_ops']}" if isa.get("cpu_ops") else "",
             f"float32 matmul {isa['float32_matmul']}" if isa.get("float32_matmul") else "",
             f"int8 matmul {isa['int8_matmul']}" if isa.get("int8_matmul") else ""]
    return _cell("; ".join(p for p in parts if p)) or "-"


def _machine_line(machine: dict[str, Any]) -> str:
    isa = machine.get("isa") or {}
    have = [flag for flag, on in isa.items() if on]
    lacks = [flag for flag, on in isa.items() if on is False]
    line = f"Machine: {machine.get('label') or machine.get('cpu')}"
    if machine.get("label"):
        line += f" (CPU {machine.get('cpu')}, {machine.get('cpu_threads')} threads)"
    if isa:
        line += f"; ISA flags: {', '.join(have) or 'none'}" + (f" (not: {', '.join(lacks)})" if lacks else "")
    return line + "."


def render_compare(summary: dict[str, Any]) -> str:
    lines = [f"# {summary['name']}", "", summary.get("description", ""), "",
             f"Measured {summary['when']} on {summary['machine'].get('label') or summary['machine']['cpu']}; "
             f"model {summary['model']['source']}; sampling {json.dumps(summary['sampling'])}.", "",
             _machine_line(summary["machine"]), ""]
    failed = summary.get("failed") or []
    if failed:
        lines += [f"**FAILED: {', '.join(failed)}** (no figures; the cause and last output of each below).", ""]
    for w in summary["workloads"]:
        wid = w.get("name") or w["kind"]
        mode = f"concurrency {w['concurrency']}" if w.get("concurrency") else f"rate {w.get('request_rate')} req/s"
        lines += [f"## {wid}: {mode}, {w['num_requests']} requests, ~{w['input_len']} in / {w['output_len']} out", "",
                  "| engine | " + " | ".join(h for _, h, _ in SHOWN) + " |",
                  "|---|" + "---:|" * len(SHOWN)]
        for label, entry in summary["engines"].items():
            if "skipped" in entry:
                lines.append(f"| {label} | skipped: {_cell(entry['skipped'])} |" + " |" * (len(SHOWN) - 1))
                continue
            if entry.get("status") == "FAILED":
                lines.append(f"| {label} | FAILED: {_cell(entry['failure']['cause'])} |" + " |" * (len(SHOWN) - 1))
                continue
            vals = entry.get("workloads", {}).get(wid, {})
            cells = [fmt.format(vals[k]) if k in vals else "-" for k, _, fmt in SHOWN]
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += _engines_section(summary) + _failures_section(summary)
    lines += [f"_Run {summary['run_id']} in the results store `{summary['store']}`; query it with "
              "`onecat results query`._", ""]
    return "\n".join(lines)


def _engines_section(summary: dict[str, Any]) -> list[str]:
    """Per engine: how it ended, the instruction sets it ran on, what else loaded the machine as it started."""
    lines = ["## Engines", "", "| engine | status | ISA used | load (1 min) at start | open s |",
             "|---|---|---|---:|---:|"]
    for label, entry in summary["engines"].items():
        status = entry.get("status") or ("skipped" if "skipped" in entry else "ran")
        load, open_s = entry.get("load_1min_at_start"), entry.get("open_s")
        lines.append(f"| {label} | {status} | {_isa_cell(entry.get('isa_used'))} | "
                     f"{'-' if load is None else f'{load:.2f}'} | {'-' if open_s is None else f'{open_s:.1f}'} |")
    return lines + [""]


def _failures_section(summary: dict[str, Any]) -> list[str]:
    """Each failed engine's cause and its last output, as the process printed it."""
    lines: list[str] = []
    for label in summary.get("failed") or []:
        failure = summary["engines"][label]["failure"]
        lines += [f"## FAILED: {label}: {failure['cause']}", ""]
        if failure.get("output_tail"):
            lines += ["Its last output:", "", "````text", failure["output_tail"].rstrip(), "````", ""]
    return lines


def render_compare_report(store: Store, run_id: str) -> str:
    return render_compare(compare_summary(store, run_id))
