"""A contract's history (results/history.py) as a table and a plot, so a slow drift shows.

    history_table(history) -> (header, rows)       the cells `onecat results history` prints
    write_history(history, folder) -> HistoryFiles <contract>-history.md and .png (the plot, when
                                                   matplotlib is there; `note` says why not otherwise)

The plot draws each chosen metric per run in run order (one panel per metric and key, one line per
arm) with the run's verdict as the marker, like asv or Bencher; with no metric chosen it draws each
gate's key number instead.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from onecat.reports.markdown import markdown_table
from onecat.reports.plots import NO_MATPLOTLIB, new_figure, save
from onecat.results.history import History

VERDICT_MARKERS = {"PROMOTE": "o", "ROLLBACK": "X", "INCONCLUSIVE": "^"}  # no verdict (a failed run): "s"


def _num(value: Optional[float]) -> str:
    return "–" if value is None else f"{value:.4g}"


def _revision(rev: Optional[str]) -> str:
    if not rev:
        return "–"
    return rev[:10] + ("-dirty" if rev.endswith("-dirty") else "")


def history_table(history: History) -> tuple[list[str], list[list[str]]]:
    gates, series = history.gate_ids(), history.series()
    header = (["run", "started (UTC)", "revision", "verdict"] + gates
              + [f"{m}[{k}] {a}" if k else f"{m} {a}" for m, k, a in series])
    rows = []
    for run in history.runs:
        cells = [run.run_id, str(run.started_at)[:19], _revision(run.engine_revision), run.verdict or run.status]
        for gate in gates:
            status, number = run.gates.get(gate, (None, None))
            cells.append(f"{status.upper()} {_num(number)}" if status else "–")
        rows.append(cells + [_num(run.metrics.get(s)) for s in series])
    return header, rows


def plot_series(history: History) -> dict[str, dict[str, list[Optional[float]]]]:
    """panel title -> line label -> one value per run (None where that run lacks it): what the plot draws."""
    panels: dict[str, dict[str, list[Optional[float]]]] = {}
    if history.series():
        for metric, key, arm in history.series():
            title = f"{metric} [{key}]" if key else metric
            panels.setdefault(title, {})[arm] = [r.metrics.get((metric, key, arm)) for r in history.runs]
        return panels
    for gate in history.gate_ids():
        panels[gate] = {"key number": [r.gates.get(gate, (None, None))[1] for r in history.runs]}
    return panels


def _draw(history: History, path: Path) -> bool:
    panels = plot_series(history)
    if not panels:
        return False
    fig, axes = new_figure(len(panels), 1, height=1.0 + 1.8 * len(panels))
    verdicts = [r.verdict for r in history.runs]
    for ax, (title, lines) in zip(axes[:, 0], panels.items()):
        for label, values in lines.items():
            xs = [i for i, v in enumerate(values) if v is not None]
            line, = ax.plot(xs, [values[i] for i in xs], "-", linewidth=1, label=label)
            for i in xs:
                ax.plot(i, values[i], VERDICT_MARKERS.get(verdicts[i], "s"), color=line.get_color(), markersize=7)
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=7, loc="best")
    last = axes[-1, 0]
    last.set_xticks(range(len(history.runs)), [f"{i + 1}\n{_revision(r.engine_revision)[:7]}"
                                               for i, r in enumerate(history.runs)], fontsize=7)
    last.set_xlabel("run (oldest first) and engine revision; marker: ● PROMOTE  ✖ ROLLBACK  ▲ INCONCLUSIVE  ■ none",
                    fontsize=7)
    fig.suptitle(f"{history.contract_name}: history", fontsize=10)
    save(fig, path)
    return True


@dataclass
class HistoryFiles:
    markdown: Path
    plot: Optional[Path]
    note: Optional[str] = None


def write_history(history: History, folder: Path) -> HistoryFiles:
    folder.mkdir(parents=True, exist_ok=True)
    stem = re.sub(r"[^A-Za-z0-9_.-]+", "-", history.contract_name) + "-history"
    plot: Optional[Path] = folder / f"{stem}.png"
    note = None
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        plot, note = None, NO_MATPLOTLIB
    if plot is not None and not _draw(history, plot):
        plot, note = None, "no chosen metric or gate has a number to plot"
    header, rows = history_table(history)
    lines: list[Any] = [f"# {history.contract_name}: history", "",
                        f"{len(history.runs)} runs, oldest first; gate cells are the status and the number the "
                        "check judged (speed ratio, relative PPL change, rate, ...).", ""]
    lines += markdown_table(header, rows)
    lines += ["", f"![history]({plot.name})" if plot else f"_No plot: {note}._", ""]
    markdown = folder / f"{stem}.md"
    markdown.write_text("\n".join(lines), encoding="utf-8")
    return HistoryFiles(markdown, plot, note)
