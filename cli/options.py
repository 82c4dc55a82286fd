"""Options that several `onecat` commands share, so they read and default the same way everywhere."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

DB_OPTION = typer.Option(None, "--db", help="DuckDB results file (default: $ONECAT_DB or .onecat/results.duckdb)")


def db_path(db: Optional[Path]) -> Path:
    from onecat.results.paths import default_db

    return db or default_db()
