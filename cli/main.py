"""The `onecat` command line.

Exit codes (all subcommands):
    0  PROMOTE (or success for non-gate commands)
    1  ROLLBACK: a binding gate failed
    2  usage or contract error (bad flags, invalid contract, unknown run)
    3  INCONCLUSIVE: no gate failed but the evidence could not decide
    4  runtime / environment error (missing model or dataset, engine failure, interrupted run)
"""
from __future__ import annotations

import importlib
import json
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from onecat.cli.options import DB_OPTION, db_path

EXIT_OK, EXIT_ROLLBACK, EXIT_USAGE, EXIT_INCONCLUSIVE, EXIT_RUNTIME = 0, 1, 2, 3, 4
EXIT_HELP = ("Exit codes: 0 PROMOTE/success, 1 ROLLBACK, 2 usage or contract error, 3 INCONCLUSIVE, "
             "4 runtime/environment error (missing model or dataset, engine failure).")

app = typer.Typer(name="onecat", help="onecat: LLM engine for V100 and a contract-driven quality-gate harness. "
                  + EXIT_HELP, no_args_is_help=True, add_completion=False)
gate_app = typer.Typer(help="Run gate contracts. " + EXIT_HELP, no_args_is_help=True)
contract_app = typer.Typer(help="Validate contracts.", no_args_is_help=True)
results_app = typer.Typer(help="Inspect the results store.", no_args_is_help=True)
app.add_typer(gate_app, name="gate")
app.add_typer(contract_app, name="contract")
app.add_typer(results_app, name="results")

console = Console()
err = Console(stderr=True)


def _fail(message: str, code: int) -> "typer.Exit":
    err.print(f"[bold red]error:[/] {message}", markup=True, highlight=False, soft_wrap=True)
    return typer.Exit(code)


# --------------------------------------------------------------------------- gate
@gate_app.command("run")
def gate_run(contract: Path = typer.Argument(..., help="contract YAML file"),
             db: Optional[Path] = DB_OPTION,
             resume: bool = typer.Option(False, "--resume", help="continue the newest unfinished run of this contract"),
             run_id: Optional[str] = typer.Option(None, "--run-id", help="with --resume: the run to continue"),
             out: Optional[Path] = typer.Option(None, "--out", help="report folder or .md file "
                                                                    "(default .onecat/reports/)"),
             no_progress: bool = typer.Option(False, "--no-progress", help="no progress bar"),
             baseline_ref: Optional[str] = typer.Option(
                 None, "--baseline-ref", metavar="REF", help="run the baseline arm's engine at this git revision "
                 "(e.g. the merge base); overrides the contract's arms.baseline.code"),
             candidate_ref: Optional[str] = typer.Option(
                 None, "--candidate-ref", metavar="REF", help="run the candidate arm's engine at this git revision "
                 "(default: the working tree); overrides arms.candidate.code"),
             reuse_baseline: bool = typer.Option(
                 False, "--reuse-baseline", help="copy the baseline's deterministic evidence (greedy generations, PPL "
                 "segments, task outcomes) from the newest complete run with the same baseline fingerprint, datasets "
                 "and environment class instead of regenerating it; speed is always measured fresh"),
             junit: Optional[Path] = typer.Option(None, "--junit", metavar="FILE",
                                                  help="also write the gates as JUnit XML (one testcase per gate)")) -> None:
    """Run both arms of CONTRACT, evaluate its gates, print the verdict and write the report.

    Exit codes: 0 PROMOTE, 1 ROLLBACK, 2 usage/contract error, 3 INCONCLUSIVE, 4 runtime/environment error.
    """
    from onecat.gates.contract import ContractError
    from onecat.gates.gate_run import PreflightError, ResumeError, run_gate
    from onecat.gates.verdict import EXIT_CODES

    from onecat.cli.progress import RichProgress

    progress = None if no_progress else RichProgress(console)
    try:
        outcome = run_gate(contract, db_path(db), resume=(run_id or True) if resume else False, report_dir=out,
                           progress=progress, code_refs={"baseline": baseline_ref, "candidate": candidate_ref},
                           reuse_baseline=reuse_baseline)
    except ContractError as exc:
        from rich.markup import escape

        raise _fail(escape(str(exc)), EXIT_USAGE)  # contract text may hold [brackets]: never markup
    except ResumeError as exc:
        raise _fail(str(exc), EXIT_USAGE)
    except PreflightError as exc:
        raise _fail(str(exc), EXIT_RUNTIME)
    except KeyboardInterrupt:
        raise _fail("interrupted; continue with `onecat gate run --resume " + str(contract) + "`", EXIT_RUNTIME)
    except Exception as exc:  # noqa: BLE001 - engine / environment failure
        raise _fail(f"{type(exc).__name__}: {exc}", EXIT_RUNTIME)
    table = Table(title=f"{outcome.run_id}", show_lines=False)
    for col in ("gate", "status", "summary"):
        table.add_column(col, overflow="fold")
    colors = {"pass": "green", "fail": "red", "inconclusive": "yellow"}
    for gate, res in outcome.results:
        name = gate.id + (" (informative)" if gate.informative else "")
        table.add_row(name, f"[{colors[res.status]}]{res.status.upper()}[/]", res.summary)
    console.print(table)
    for w in outcome.warnings:
        console.print(f"[yellow]warning:[/] {w}", highlight=False)
    color = {"PROMOTE": "green", "ROLLBACK": "red"}.get(outcome.verdict.decision, "yellow")
    console.print(f"[bold {color}]{outcome.verdict.decision}[/] — {outcome.verdict.reason}")
    console.print(f"run {outcome.run_id}: {outcome.wall_s:.1f}s, {outcome.steps_run} units run, "
                  f"{outcome.steps_skipped} resumed", highlight=False)
    console.print(f"report: {outcome.report_path}", highlight=False, soft_wrap=True)
    if junit is not None:
        _write_junit(db_path(db), outcome.run_id, junit)
    raise typer.Exit(EXIT_CODES[outcome.verdict.decision])


def _write_junit(db: str, run_id: str, path: Path) -> None:
    from onecat.reports.junit import write_junit
    from onecat.results.store import Store

    try:
        with Store(db, read_only=True) as store:
            console.print(f"junit: {write_junit(store, run_id, path)}", highlight=False, soft_wrap=True)
    except OSError as exc:
        raise _fail(f"--junit {path}: cannot write it ({exc}); give a writable file path", EXIT_RUNTIME)


# --------------------------------------------------------------------------- contract
@contract_app.command("check")
def contract_check(files: List[Path] = typer.Argument(..., help="contract YAML files")) -> None:
    """Validate contracts: schema, size limits, unknown keys, registered kinds/checks/datasets, requests that fit
    max_model_len. Exit 2 on any error."""
    from onecat.gates.contract import ContractError, contract_warnings, load_feasible_contract

    bad = 0
    for f in files:
        try:
            c = load_feasible_contract(f)
        except ContractError as exc:
            bad += 1
            err.print(str(exc), highlight=False, markup=False, soft_wrap=True)
            continue
        except Exception as exc:  # noqa: BLE001 - a validator bug must still name the file, not dump a traceback
            bad += 1
            err.print(f"{f}: could not be validated ({type(exc).__name__}: {exc})", highlight=False, markup=False,
                      soft_wrap=True)
            continue
        console.print(f"[green]ok[/] {f}: {c.name} (fingerprint {c.fingerprint[:16]}, baseline "
                      f"{c.arm('baseline').fingerprint[:12]}, candidate {c.arm('candidate').fingerprint[:12]}, "
                      f"{len(c.workloads)} workloads, {len(c.gates)} gates)", highlight=False)
        for w in contract_warnings(c):
            console.print(f"  [yellow]warning:[/] {w}", highlight=False)
    raise typer.Exit(EXIT_USAGE if bad else EXIT_OK)


# --------------------------------------------------------------------------- results
@contextmanager
def _store(db: Optional[Path]):
    """The store, opened to read: a snapshot while a run writes it; a damaged or busy store is an error
    (exit 4) that says what to do, never a traceback."""
    from rich.markup import escape

    from onecat.results.errors import StoreError, as_store_error
    from onecat.results.reading import open_for_reading

    path = db_path(db)
    if not Path(path).exists():
        raise _fail(f"no results store at {path}; run `onecat gate run CONTRACT` first or pass --db", EXIT_USAGE)
    try:
        store = open_for_reading(path)
    except StoreError as exc:
        raise _fail(escape(str(exc)), EXIT_RUNTIME)
    try:
        if store.snapshot_of:
            err.print(f"[cyan]note:[/] {escape(store.describe())}", highlight=False, soft_wrap=True)
        for w in store.warnings:
            err.print(f"[yellow]warning:[/] {escape(w)}", highlight=False, soft_wrap=True)
        yield store
    except Exception as exc:  # noqa: BLE001 - a damaged block found while reading
        problem = as_store_error(path, exc)
        if problem is None:
            raise
        raise _fail(escape(str(problem)), EXIT_RUNTIME)
    finally:
        store.close()


def _run_id(store, run: Optional[str]) -> str:
    try:
        return store.resolve_run_id(run)
    except LookupError as exc:
        raise _fail(str(exc), EXIT_USAGE)


@results_app.command("list")
def results_list(db: Optional[Path] = DB_OPTION, limit: int = typer.Option(20, help="newest N runs")) -> None:
    """List runs, newest first."""
    with _store(db) as store:
        rows = store.runs(limit)
    table = Table()
    for col in ("run", "contract", "status", "verdict", "started (UTC)"):
        table.add_column(col)
    table.add_column("note", overflow="fold")
    for r in rows:
        kind = f" ({r['kind']})" if r.get("kind") not in (None, "gate") else ""  # e.g. a `bench compare` run
        table.add_row(r["run_id"], Text((r["contract_name"] or "?") + kind), r["status"], r["verdict"] or "–",
                      str(r["started_at"])[:19], Text(_run_note(r)))
    console.print(table)


def _run_note(run: dict) -> str:
    """One short line: who writes a running run, what to do about one that stopped (`results show` says why)."""
    status = run["status"]
    if status == "running":
        return f"writer pid {run['writer_pid']} on {run.get('writer_host')}" if run.get("writer_pid") else ""
    if status == "interrupted":
        return "stopped before finishing; `gate run --resume` continues it"
    if status == "lost":
        return "its rows are gone (write-ahead log truncated); rerun it"
    return (run.get("error") or "")[:80] if status == "failed" else ""


@results_app.command("show")
def results_show(run: Optional[str] = typer.Argument(None, help="run id or unique prefix (default: newest)"),
                 db: Optional[Path] = DB_OPTION) -> None:
    """Show one run's gates and verdict."""
    with _store(db) as store:
        _show(store, _run_id(store, run))


def _show(store, rid: str) -> None:
    row = store.run(rid)
    console.print(f"[bold]{rid}[/] {row['contract_name']} status={row['status']} verdict={row['verdict']}",
                  highlight=False)
    if row.get("error") and row["status"] != "complete":
        console.print(f"  {row['error']}", highlight=False, markup=False)
    table = Table()
    if row.get("kind") == "compare":  # engines side by side: which ran, and why the others did not
        for col in ("engine", "status", "note"):
            table.add_column(col, overflow="fold")
        for o in store.arm_outcomes(rid):
            note = o["error"] or (f"opened in {o['open_s']:.1f}s" if o["open_s"] is not None else "")
            table.add_row(o["arm"], o["status"], Text(note))
    else:
        for col in ("gate", "status", "summary"):
            table.add_column(col, overflow="fold")
        for c in store.checks(rid):
            table.add_row(c["gate_id"], c["status"].upper(), c["summary"] or "")
    console.print(table)
    cols, rows = store.query("SELECT arm, workload, count(*) FROM requests WHERE run_id = ? GROUP BY ALL ORDER BY ALL",
                             [rid])
    for r in rows:
        console.print(f"  {r[0]:<10} {r[1]:<24} {r[2]} requests", highlight=False)


@results_app.command("query")
def results_query(sql: str = typer.Argument(..., help="SQL over runs, environment, requests, item_outcomes, "
                                                      "metrics, units, checks, verdicts, arm_outcomes"),
                  db: Optional[Path] = DB_OPTION,
                  fmt: str = typer.Option("table", "--format", help="table | json | csv")) -> None:
    """Run SQL against the store (read-only)."""
    from rich.markup import escape

    from onecat.results.errors import as_store_error

    with _store(db) as store:
        try:
            cols, rows = store.query(sql)
        except Exception as exc:  # noqa: BLE001 - duckdb errors name the problem
            problem = as_store_error(store.path, exc)  # a damaged store, not a bad query
            if problem is not None:
                raise _fail(escape(str(problem)), EXIT_RUNTIME)
            raise _fail(f"query failed: {exc}", EXIT_USAGE)
    if fmt == "json":
        print(json.dumps([dict(zip(cols, r)) for r in rows], default=str, indent=1))
    elif fmt == "csv":
        import csv

        w = csv.writer(sys.stdout)
        w.writerow(cols)
        w.writerows(rows)
    else:
        table = Table()
        for c in cols:
            table.add_column(c, overflow="fold")
        for r in rows:
            table.add_row(*["" if v is None else str(v) for v in r])
        console.print(table)


@results_app.command("export")
def results_export(run: Optional[str] = typer.Argument(None, help="run id or prefix (default: newest)"),
                   db: Optional[Path] = DB_OPTION,
                   fmt: str = typer.Option("json", "--format", help="json | csv"),
                   out: Path = typer.Option(Path(".onecat") / "export", "--out", help="folder for the files")) -> None:
    """Export every table of one run as JSON or CSV files."""
    from onecat.results.export import export_run

    if fmt not in ("json", "csv"):
        raise _fail(f"--format {fmt!r}; use json or csv", EXIT_USAGE)
    with _store(db) as store:
        paths = export_run(store, _run_id(store, run), out, fmt)
    for p in paths:
        console.print(str(p), highlight=False)


@results_app.command("history")
def results_history(contract_name: str = typer.Argument(..., help="contract name (as `results list` shows it)"),
                    metric: Optional[List[str]] = typer.Option(None, "--metric", help="metric to follow per arm, "
                                                               "repeatable (default: the metrics its gates name)"),
                    db: Optional[Path] = DB_OPTION,
                    out: Optional[Path] = typer.Option(None, "--out", help="folder for <contract>-history.md and "
                                                                           ".png (default .onecat/reports/)")) -> None:
    """A contract's runs across time and revisions: verdict, each gate's status and key number, the chosen
    metrics per arm; printed as a table and written as markdown with a plot (marker per verdict)."""
    from onecat.reports.history import history_table, write_history
    from onecat.results.history import contract_history
    from onecat.results.paths import DEFAULT_REPORT_DIR

    with _store(db) as store:
        try:
            history = contract_history(store, contract_name, metric)
        except LookupError as exc:
            raise _fail(str(exc), EXIT_USAGE)
    header, rows = history_table(history)
    table = Table(title=f"{contract_name}: {len(rows)} runs, oldest first")
    for col in header:
        table.add_column(col, overflow="fold")
    for row in rows:
        table.add_row(*[Text(cell) for cell in row])
    console.print(table)
    files = write_history(history, out or DEFAULT_REPORT_DIR)
    console.print(f"history: {files.markdown}" + (f", plot: {files.plot}" if files.plot else ""), highlight=False,
                  soft_wrap=True)
    if files.note:
        console.print(f"[yellow]note:[/] no plot: {files.note}", highlight=False)


# --------------------------------------------------------------------------- switches
@app.command("switches")
def switches(json_out: bool = typer.Option(False, "--json", help="Print the list as JSON.")) -> None:
    """The engine's on/off environment switches (ONECAT_*=1 / 0, unset for the default): each one's default,
    the value set here, where it is declared and what its declaration says."""
    from rich.table import Table

    from onecat.engine.switches import declared

    found = declared()
    if json_out:
        typer.echo(json.dumps(found, indent=1))
        return
    shown = {True: "on", False: "off", None: "engine's choice"}
    table = Table(title="engine switches (1 on, 0 off, unset: the default)")
    for column in ("switch", "default", "set here", "declared at"):
        table.add_column(column, no_wrap=True)
    table.add_column("what it does", overflow="fold", min_width=30)
    for e in found:
        table.add_row(e["name"], shown[e["default"]], "unset" if e["set_to"] is None else repr(e["set_to"]),
                      e["where"], e["about"])
    console.print(table)


# --------------------------------------------------------------------------- report
@app.command("report")
def report(run: Optional[str] = typer.Argument(None, help="run id or prefix (default: newest)"),
           db: Optional[Path] = DB_OPTION,
           out: Optional[Path] = typer.Option(None, "--out", help="folder or .md file (default .onecat/reports/)")) -> None:
    """(Re-)render the markdown report of a run from the store and print its path."""
    from onecat.reports.markdown import write_report

    with _store(db) as store:
        path = write_report(store, _run_id(store, run), out)
    console.print(str(path), highlight=False)


# --------------------------------------------------------------------------- sub-apps from sibling modules
def _add_broken(name: str, exc: Exception) -> None:
    broken = typer.Typer(help=f"(unavailable: {type(exc).__name__}: {exc})")

    @broken.callback(invoke_without_command=True)
    def _unavailable() -> None:
        raise _fail(f"`onecat {name}` failed to load: {type(exc).__name__}: {exc}", EXIT_RUNTIME)

    app.add_typer(broken, name=name)


def _add_optional_subapps() -> None:
    """`onecat bench|serve|kernels` live in cli/bench.py, cli/serve.py, cli/kernels.py when present."""
    for name in ("bench", "serve", "kernels", "drafter"):
        try:
            module = importlib.import_module(f"onecat.cli.{name}")
        except ModuleNotFoundError as exc:
            if exc.name == f"onecat.cli.{name}":
                continue
            _add_broken(name, exc)
            continue
        except Exception as exc:  # noqa: BLE001 - a broken sibling must not take `gate run` down
            _add_broken(name, exc)
            continue
        sub = getattr(module, "app", None)
        if isinstance(sub, typer.Typer):
            app.add_typer(sub, name=name)


_add_optional_subapps()

if __name__ == "__main__":
    app()
