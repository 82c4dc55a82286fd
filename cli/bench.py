"""`onecat bench compare FILE`: several engines under the same prompts, sampling and endpoint load."""
from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional

import typer

from onecat.cli.options import DB_OPTION, db_path
from onecat.results.paths import DEFAULT_COMPARE_DIR

app = typer.Typer(help="Benchmarks: side-by-side engine comparisons.", no_args_is_help=True, add_completion=False)


@app.command("compare")
def compare(spec_file: Path = typer.Argument(..., help="comparison YAML (e.g. contracts/peers_cpu.yaml)"),
            only: Optional[List[str]] = typer.Option(None, "--only", help="run only these engine labels"),
            db: Optional[Path] = DB_OPTION,
            out: Path = typer.Option(DEFAULT_COMPARE_DIR, "--out", help="folder for the JSON and markdown"),
            record: Optional[Path] = typer.Option(None, "--record", help="also copy the JSON here"),
            machine: Optional[str] = typer.Option(None, "--machine", envvar="ONECAT_MACHINE_LABEL",
                                                  help="label of this machine in the record (default: its CPU, "
                                                       "thread count and widest vector ISA)")) -> None:
    """Run every engine of SPEC_FILE (one at a time) into the results store as one run of kind "compare",
    print one table, and write it as JSON and markdown. Exit 2 on a bad file or --only label, 4 when an
    engine FAILED (its server died, or every request of a workload failed), when no engine could run, or
    when the store cannot be written."""
    from onecat.gates.compare import CompareError, check_labels, load_compare, run_compare
    from onecat.reports.compare import compare_summary, render_compare
    from onecat.reports.markdown import plots_section
    from onecat.reports.plots import write_plots
    from onecat.results.errors import StoreError
    from onecat.results.store import Store

    try:
        spec = load_compare(spec_file)
        check_labels(spec, only)
    except CompareError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2)
    path = db_path(db)
    try:
        with Store(path) as store:
            run_id = run_compare(spec, store, str(spec_file), only=list(only or []) or None,
                                 log=lambda s: typer.echo(s, err=True), machine_label=machine)
            summary = compare_summary(store, run_id)
    except StoreError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(4)
    text = json.dumps(summary, indent=2, default=str) + "\n"
    out.mkdir(parents=True, exist_ok=True)
    stem = f"{spec.name}-{summary['when'].replace(':', '').replace('+0000', 'Z')}"
    with Store(path, read_only=True) as store:  # throughput vs load, latency percentiles per engine
        plots = write_plots(store, run_id, out / f"{stem}-plots")
    md = "\n".join([render_compare(summary), *plots_section(plots, out)])
    (out / f"{stem}.json").write_text(text)
    (out / f"{stem}.md").write_text(md + "\n")
    if record:
        record.parent.mkdir(parents=True, exist_ok=True)
        record.write_text(text)
    typer.echo(md)
    typer.echo(f"written: run {run_id} in {path}, {out / (stem + '.json')}, {out / (stem + '.md')}", err=True)
    if summary["failed"]:
        typer.echo(f"error: FAILED: {', '.join(summary['failed'])} (causes and last output in "
                   f"{out / (stem + '.md')})", err=True)
        raise typer.Exit(4)
    if all(e["status"] != "ran" for e in summary["engines"].values()):
        raise typer.Exit(4)
