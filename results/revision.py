"""The code a result was measured with (git revision, onecat version), so every stored figure names it."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Sequence

REPO_ROOT = Path(__file__).resolve().parent.parent  # the checkout, in a source (editable) install
UNKNOWN = "unknown"


def git_revision(paths: Sequence[str] = (), repo: str | os.PathLike = REPO_ROOT) -> str:
    """The newest commit touching `paths` (all of `repo` when none), + "-dirty" when they have uncommitted
    changes; "unknown" outside a git checkout (an installed wheel) or without git."""
    try:
        rev = subprocess.run(["git", "log", "-1", "--format=%H", "--", *paths], cwd=repo, capture_output=True,
                             text=True, timeout=10)
        if rev.returncode != 0 or not rev.stdout.strip():
            return UNKNOWN
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", *paths], cwd=repo,
                               capture_output=True, text=True, timeout=10)
        return rev.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return UNKNOWN


def engine_revision() -> str:
    """The newest commit touching the engine sources (engine/, csrc/)."""
    return git_revision(("engine", "csrc"))


def onecat_version() -> str:
    """The installed onecat distribution's version, else "unknown"."""
    try:
        import importlib.metadata

        return importlib.metadata.version("onecat")
    except Exception:  # noqa: BLE001 - not installed, or broken metadata
        return UNKNOWN
