"""The numbers each report plot draws, read only from the store (no matplotlib here).

    gate_plot_data(store, run_id) -> list[SpeedPlot | PplPlot | StopRatePlot | AcceptancePlot]
    compare_plot_data(summary)    -> list[ThroughputPlot | LatencyPlot]   (a `bench compare` summary)

Gate plots draw what the checks judged, as the checks stored it: a speed gate's paired ratios and
bootstrap interval (`checks.evidence_json.pairs`, `statistic_json`), a PPL gate's per-segment relative
deltas (`evidence_json.per_segment_relative`). Rates come from the `requests` rows with the same
filters the natural-stop and capped checks apply (eligible, not failed). Kept apart from the drawing
so a test can hold every plotted number to the stored one.
"""
from __future__ import annotations

import json
import re
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Optional

from onecat.results.records import FAILED_FINISH_REASONS
from onecat.results.store import Store


@dataclass
class SpeedPlot:
    """A speed gate: one ratio per interleaved repeat pair, the interval around their mean, the bound."""

    gate_id: str
    status: str
    metric: str
    labels: list[str]       # "<key> r<repeat>" per pair
    ratios: list[float]     # candidate / bracketing baseline mean, as the check computed it
    bound: float
    estimate: Optional[float] = None  # absent when the check had too few pairs to decide
    low: Optional[float] = None
    high: Optional[float] = None


@dataclass
class PplPlot:
    """A PPL gate: each segment's relative PPL change, the interval over segments, the bound."""

    gate_id: str
    status: str
    segments: list[str]
    relative: list[float]
    bound: float
    estimate: Optional[float] = None
    low: Optional[float] = None
    high: Optional[float] = None


@dataclass
class StopRatePlot:
    """Natural-stop and capped rates per (workload, arm) over requests that were free to stop."""

    groups: list[tuple[str, str]] = field(default_factory=list)  # (workload, arm)
    eligible: list[int] = field(default_factory=list)
    natural_stop_rate: list[float] = field(default_factory=list)
    capped_rate: list[float] = field(default_factory=list)


@dataclass
class AcceptancePlot:
    """Speculative decoding: share of drafts whose token at each position was accepted, per arm."""

    workload: str
    arms: list[str] = field(default_factory=list)
    drafts: list[int] = field(default_factory=list)
    rate_per_position: list[list[float]] = field(default_factory=list)


@dataclass
class ThroughputPlot:
    """`bench compare`: output tok/s per engine at each closed-loop concurrency (or open-loop rate)."""

    load_label: str  # "concurrency" or "request rate (req/s)"
    engines: dict[str, list[tuple[float, float]]] = field(default_factory=dict)  # engine -> [(load, tok/s)]


@dataclass
class LatencyPlot:
    """`bench compare`: TTFT and TPOT percentiles per engine for one workload."""

    workload: str
    percentiles: list[int] = field(default_factory=list)
    ttft_s: dict[str, list[Optional[float]]] = field(default_factory=dict)  # engine -> one per percentile
    tpot_s: dict[str, list[Optional[float]]] = field(default_factory=dict)


def _natural_key(text: str) -> list:
    """"segment=10" after "segment=9"."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text)]


def _speed_plot(check: dict, statistic: dict, evidence: dict) -> Optional[SpeedPlot]:
    pairs = evidence.get("pairs")
    if not pairs or "bound" not in statistic or not all("ratio" in p for p in pairs):
        return None
    return SpeedPlot(gate_id=check["gate_id"], status=check["status"], metric=statistic.get("metric", ""),
                     labels=[f"{p['key']} r{p['repeat']}" for p in pairs], ratios=[float(p["ratio"]) for p in pairs],
                     bound=float(statistic["bound"]), estimate=statistic.get("estimate"), low=statistic.get("low"),
                     high=statistic.get("high"))


def _ppl_plot(check: dict, statistic: dict, evidence: dict) -> Optional[PplPlot]:
    per_segment = evidence.get("per_segment_relative")
    if not per_segment or "max_relative" not in statistic:
        return None
    segments = sorted(per_segment, key=_natural_key)
    return PplPlot(gate_id=check["gate_id"], status=check["status"], segments=segments,
                   relative=[float(per_segment[s]) for s in segments], bound=float(statistic["max_relative"]),
                   estimate=statistic.get("estimate"), low=statistic.get("low"), high=statistic.get("high"))


def _stop_rates(store: Store, run_id: str) -> Optional[StopRatePlot]:
    _, rows = store.query(
        "SELECT workload, arm, count(*), sum(CASE WHEN natural_stop THEN 1 ELSE 0 END),"
        " sum(CASE WHEN capped THEN 1 ELSE 0 END) FROM requests WHERE run_id = ? AND natural_stop_eligible"
        " AND error IS NULL AND NOT list_contains(?, coalesce(finish_reason, ''))"
        " GROUP BY workload, arm ORDER BY workload, arm", [run_id, list(FAILED_FINISH_REASONS)])
    if not rows:
        return None
    plot = StopRatePlot()
    for workload, arm, n, stops, capped in rows:
        plot.groups.append((workload, arm))
        plot.eligible.append(int(n))
        plot.natural_stop_rate.append(stops / n)
        plot.capped_rate.append(capped / n)
    return plot


def _acceptance(store: Store, run_id: str) -> list[AcceptancePlot]:
    drafts: dict = defaultdict(int)
    accepted: dict = defaultdict(list)
    for r in store.requests(run_id):
        if r["error"] or not r["spec_num_drafts"]:
            continue
        group = (r["workload"], r["arm"])
        drafts[group] += int(r["spec_num_drafts"])
        per_position = json.loads(r["spec_accepted_per_position_json"] or "[]")
        total = accepted[group]
        total.extend([0] * (len(per_position) - len(total)))
        for i, n in enumerate(per_position):
            total[i] += n
    plots: dict[str, AcceptancePlot] = {}
    for (workload, arm), n in sorted(drafts.items()):
        plot = plots.setdefault(workload, AcceptancePlot(workload))
        plot.arms.append(arm)
        plot.drafts.append(n)
        plot.rate_per_position.append([a / n for a in accepted[(workload, arm)]])
    return list(plots.values())


def gate_plot_data(store: Store, run_id: str) -> list[Any]:
    """Every plot a gate run's report carries, in report order: gates first, then health, then acceptance."""
    plots: list[Any] = []
    for check in store.checks(run_id):
        statistic = json.loads(check["statistic_json"] or "{}")
        evidence = json.loads(check["evidence_json"] or "{}")
        plot = _speed_plot(check, statistic, evidence) or _ppl_plot(check, statistic, evidence)
        if plot is not None:
            plots.append(plot)
    rates = _stop_rates(store, run_id)
    if rates is not None:
        plots.append(rates)
    return plots + _acceptance(store, run_id)


_PERCENTILE = re.compile(r"^(ttft|tpot)_p(\d+)_s$")


def _latency_plot(workload: str, engines: dict[str, Any]) -> Optional[LatencyPlot]:
    found: dict[str, dict[tuple[str, int], float]] = {}
    for label, entry in engines.items():
        figures = (entry.get("workloads") or {}).get(workload, {})
        percentiles = {(m.group(1), int(m.group(2))): v for name, v in figures.items()
                       if (m := _PERCENTILE.match(name))}
        if percentiles:
            found[label] = percentiles
    if not found:
        return None
    qs = sorted({q for percentiles in found.values() for _, q in percentiles})
    return LatencyPlot(workload, qs, ttft_s={e: [f.get(("ttft", q)) for q in qs] for e, f in found.items()},
                       tpot_s={e: [f.get(("tpot", q)) for q in qs] for e, f in found.items()})


def compare_plot_data(summary: dict[str, Any]) -> list[Any]:
    """Plots of a `bench compare` summary (reports/compare.py): the figures its tables show."""
    closed = [w for w in summary["workloads"] if w.get("concurrency")]
    loaded = closed or [w for w in summary["workloads"] if w.get("request_rate")]
    throughput = ThroughputPlot("concurrency" if closed else "request rate (req/s)")
    for label, entry in summary["engines"].items():
        figures = entry.get("workloads") or {}
        points = [(float(w.get("concurrency") or w["request_rate"]), figures[wid]["output_tok_s"])
                  for w in loaded if "output_tok_s" in figures.get(wid := w.get("name") or w["kind"], {})]
        if points:
            throughput.engines[label] = sorted(points)
    plots: list[Any] = [throughput] if throughput.engines else []
    for w in summary["workloads"]:
        latency = _latency_plot(w.get("name") or w["kind"], summary["engines"])
        if latency is not None:
            plots.append(latency)
    return plots
