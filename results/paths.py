"""Where generated output goes unless the user says otherwise: a git-ignored `.onecat/` work folder.

    default_db()          $ONECAT_DB, else .onecat/results.duckdb   (`gate run`, `bench compare`, `results`)
    DEFAULT_REPORT_DIR    .onecat/reports/   (gate reports: <run_id>.md)
    DEFAULT_COMPARE_DIR   .onecat/compare/   (`bench compare` JSON and markdown)
"""
from __future__ import annotations

import os
from pathlib import Path

WORK_DIR = Path(".onecat")
DEFAULT_REPORT_DIR = WORK_DIR / "reports"
DEFAULT_COMPARE_DIR = WORK_DIR / "compare"


def default_db() -> Path:
    return Path(os.environ.get("ONECAT_DB") or WORK_DIR / "results.duckdb")
