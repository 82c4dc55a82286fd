"""`onecat bench compare FILE`: several engines under the same prompts, sampling and endpoint load."""
from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional

import typer

app = typer.Typer(help="Benchmarks: side-by-side engine comparisons.", no_args_is_help=True, add_completion=False)


@app.command("compare")
def compare(spec_file: Path = typer.Argument(..., help="comparison YAML (e.g. contracts/peers_cpu.yaml)"),
            only: Optional[List[str]] = typer.Option(None, "--only", help="run only these engine labels"),
            out: Path = typer.Option(Path(".onecat/compare"), "--out", help="folder for the JSON and markdown"),
            record: Optional[Path] = typer.Option(None, "--record", help="also copy the JSON here")) -> None:
    """Run every engine of SPEC_FILE (one at a time) and print one table. Exit 2 on a bad file,
    4 when no engine could run."""
    from onecat.gates.compare import CompareError, load_compare, render_markdown, run_compare

    try:
        spec = load_compare(spec_file)
    except CompareError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2)
    result = run_compare(spec, only=list(only or []) or None, log=lambda s: typer.echo(s, err=True))
    out.mkdir(parents=True, exist_ok=True)
    stem = f"{spec.name}-{result['when'].replace(':', '').replace('+0000', 'Z')}"
    (out / f"{stem}.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    md = render_markdown(result)
    (out / f"{stem}.md").write_text(md + "\n")
    if record:
        record.parent.mkdir(parents=True, exist_ok=True)
        record.write_text(json.dumps(result, indent=2, default=str) + "\n")
    typer.echo(md)
    typer.echo(f"written: {out / (stem + '.json')}, {out / (stem + '.md')}", err=True)
    if all("skipped" in e or "error" in e for e in result["engines"].values()):
        raise typer.Exit(4)
