"""JSON / CSV export of one run (every table, filtered to the run) for use outside DuckDB."""
from __future__ import annotations

import csv
import json
from pathlib import Path

from onecat.results.store import Store

TABLES = ("runs", "environment", "arm_outcomes", "requests", "item_outcomes", "metrics", "units", "checks", "verdicts")


def export_run(store: Store, run_id: str, out_dir: str | Path, fmt: str = "json") -> list[Path]:
    if fmt not in ("json", "csv"):
        raise ValueError(f"export format {fmt!r}; use json or csv")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for table in TABLES:
        cols, rows = store.query(f"SELECT * FROM {table} WHERE run_id = ?", [run_id])
        path = out / f"{run_id}.{table}.{fmt}"
        if fmt == "json":
            path.write_text(json.dumps([dict(zip(cols, r)) for r in rows], indent=1, default=str), encoding="utf-8")
        else:
            with open(path, "w", newline="", encoding="utf-8") as fh:
                w = csv.writer(fh)
                w.writerow(cols)
                w.writerows(rows)
        written.append(path)
    return written
