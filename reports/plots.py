"""PNG plots for a report, drawn with matplotlib's Agg canvas (never a display) from plot_data.py.

    write_plots(store, run_id, folder) -> Plots   the files written under `folder`, or why there are none

A report still renders without matplotlib: `Plots.note` then says why it has no plots.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from onecat.reports.plot_data import (AcceptancePlot, LatencyPlot, PplPlot, SpeedPlot, StopRatePlot, ThroughputPlot,
                                      compare_plot_data, gate_plot_data)
from onecat.results.store import Store

DPI = 80            # small files: the plots are read on a page, not printed
WIDTH_IN, HEIGHT_IN = 6.4, 3.2
STATUS_COLORS = {"pass": "tab:green", "fail": "tab:red", "inconclusive": "tab:orange"}
NO_MATPLOTLIB = "matplotlib is not installed, so this report has no plots (`pip install 'matplotlib>=3.7'`)"


@dataclass
class Plots:
    files: list[tuple[str, Path]] = field(default_factory=list)  # (title, file)
    note: Optional[str] = None  # why some or all plots are missing


def new_figure(rows: int = 1, cols: int = 1, height: float = HEIGHT_IN) -> tuple[Any, Any]:
    from matplotlib.figure import Figure  # Agg canvas; pyplot (and its display backends) never loads

    fig = Figure(figsize=(WIDTH_IN, height), layout="constrained")
    return fig, fig.subplots(rows, cols, squeeze=False)


def _interval(ax: Any, estimate: Optional[float], low: Optional[float], high: Optional[float], what: str) -> None:
    if low is not None and high is not None:
        ax.axhspan(low, high, color="tab:blue", alpha=0.15, label=f"{what} interval [{low:.4g}, {high:.4g}]")
    if estimate is not None:
        ax.axhline(estimate, color="tab:blue", linewidth=1.2, label=f"{what} {estimate:.4g}")


def _judged_against(ax: Any, plot: SpeedPlot | PplPlot, bound_label: str, ticks: list[str], ylabel: str) -> None:
    """What a gate plot shares: the bound it was judged against, one tick per pair or segment, its status."""
    ax.axhline(plot.bound, color="tab:red", linestyle="--", label=bound_label)
    ax.set_xticks(range(len(ticks)), ticks, rotation=30, ha="right", fontsize=7)
    ax.set_ylabel(ylabel)
    ax.set_title(f"{plot.gate_id}: {plot.status.upper()}", fontsize=10)
    ax.legend(fontsize=7, loc="best")


def _speed(plot: SpeedPlot) -> tuple[str, Any]:
    fig, axes = new_figure()
    ax = axes[0][0]
    ax.plot(range(len(plot.ratios)), plot.ratios, "o", color=STATUS_COLORS.get(plot.status, "k"),
            label="candidate / bracketing baseline")
    _interval(ax, plot.estimate, plot.low, plot.high, "geometric mean")
    ax.margins(x=0.15)
    _judged_against(ax, plot, f"threshold {plot.bound:.4g}", plot.labels, f"{plot.metric} ratio")
    return f"{plot.gate_id}: paired {plot.metric} ratios", fig


def _ppl(plot: PplPlot) -> tuple[str, Any]:
    fig, axes = new_figure()
    ax = axes[0][0]
    ax.bar(range(len(plot.relative)), plot.relative, color=STATUS_COLORS.get(plot.status, "tab:gray"),
           label="per-segment relative PPL change")
    _interval(ax, plot.estimate, plot.low, plot.high, "pooled")
    ax.axhline(0.0, color="k", linewidth=0.6)
    _judged_against(ax, plot, f"bound {plot.bound:+.3g}", [s.rsplit("/", 1)[-1] for s in plot.segments],
                    "candidate / baseline PPL - 1")
    return f"{plot.gate_id}: per-segment PPL deltas", fig


def _stop_rates(plot: StopRatePlot) -> tuple[str, Any]:
    fig, axes = new_figure()
    ax = axes[0][0]
    x = range(len(plot.groups))
    ax.bar([i - 0.2 for i in x], plot.natural_stop_rate, width=0.4, label="natural stop", color="tab:green")
    ax.bar([i + 0.2 for i in x], plot.capped_rate, width=0.4, label="capped", color="tab:red")
    ax.set_xticks(list(x), [f"{w}\n{a} (n={n})" for (w, a), n in zip(plot.groups, plot.eligible)], fontsize=7)
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("share of eligible requests")
    ax.set_title("Natural-stop and capped rates per arm", fontsize=10)
    ax.legend(fontsize=7)
    return "natural-stop and capped rates per arm", fig


def _acceptance(plot: AcceptancePlot) -> tuple[str, Any]:
    fig, axes = new_figure()
    ax = axes[0][0]
    for arm, n, rates in zip(plot.arms, plot.drafts, plot.rate_per_position):
        ax.plot(range(1, len(rates) + 1), rates, "o-", label=f"{arm} ({n} drafts)")
    ax.set_xlabel("draft position")
    ax.set_ylabel("accepted / drafts")
    ax.set_ylim(0, 1.05)
    ax.set_title(f"{plot.workload}: acceptance per draft position", fontsize=10)
    ax.legend(fontsize=7)
    return f"{plot.workload}: acceptance per draft position", fig


def _throughput(plot: ThroughputPlot) -> tuple[str, Any]:
    fig, axes = new_figure()
    ax = axes[0][0]
    for engine, points in plot.engines.items():
        ax.plot([p for p, _ in points], [v for _, v in points], "o-", label=engine)
    ax.set_xlabel(plot.load_label)
    ax.set_ylabel("output tok/s")
    ax.set_title(f"Throughput vs {plot.load_label}", fontsize=10)
    ax.legend(fontsize=7)
    return f"throughput vs {plot.load_label}", fig


def _latency(plot: LatencyPlot) -> tuple[str, Any]:
    fig, axes = new_figure(1, 2)
    engines = list(plot.ttft_s)
    width = 0.8 / max(len(engines), 1)
    for ax, (what, values) in zip(axes[0], (("TTFT", plot.ttft_s), ("TPOT", plot.tpot_s))):
        for j, engine in enumerate(engines):
            ax.bar([i + j * width for i in range(len(plot.percentiles))],
                   [v if v is not None else 0.0 for v in values[engine]], width=width, label=engine)
        ax.set_xticks([i + width * (len(engines) - 1) / 2 for i in range(len(plot.percentiles))],
                      [f"p{q}" for q in plot.percentiles])
        ax.set_ylabel(f"{what} (s)")
        ax.set_title(f"{plot.workload}: {what}", fontsize=10)
    axes[0][0].legend(fontsize=7)
    return f"{plot.workload}: TTFT / TPOT percentiles", fig


DRAW: dict[type, Callable[[Any], tuple[str, Any]]] = {
    SpeedPlot: _speed, PplPlot: _ppl, StopRatePlot: _stop_rates, AcceptancePlot: _acceptance,
    ThroughputPlot: _throughput, LatencyPlot: _latency}


def plot_data(store: Store, run_id: str) -> list[Any]:
    """What a run's report plots: a `bench compare` run's engines, or a gate run's gates and health."""
    run = store.run(run_id)
    if run is not None and run.get("kind") == "compare":
        from onecat.reports.compare import compare_summary

        return compare_plot_data(compare_summary(store, run_id))
    return gate_plot_data(store, run_id)


def file_name(index: int, title: str) -> str:
    return f"{index:02d}-" + (re.sub(r"[^A-Za-z0-9]+", "-", title).strip("-").lower()[:60] or "plot") + ".png"


def save(fig: Any, path: Path) -> None:
    fig.savefig(path, dpi=DPI, metadata={"Software": None})  # no version stamp: the same run, the same bytes


def write_plots(store: Store, run_id: str, folder: Path) -> Plots:
    """Draw every plot of the run into `folder` (its older PNGs are replaced)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return Plots(note=NO_MATPLOTLIB)
    data = plot_data(store, run_id)
    if folder.is_dir():
        for old in folder.glob("*.png"):
            old.unlink()
    if not data:
        return Plots(note="this run stored nothing to plot (no speed or PPL gate evidence, no free-stopping "
                          "generations, no speculative drafts)")
    folder.mkdir(parents=True, exist_ok=True)
    plots = Plots()
    for index, item in enumerate(data, 1):
        title, fig = DRAW[type(item)](item)
        path = folder / file_name(index, title)
        save(fig, path)
        plots.files.append((title, path))
    return plots
