"""The EvalPlus that `scripts/setup.sh test` installs (without its API-client dependencies) works as
installed: its `evalplus.evaluate` command, which lands on the venv's PATH, starts."""
from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

import pytest


def test_evalplus_evaluate_command_starts(tmp_path):
    try:
        importlib.metadata.version("evalplus")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("evalplus is not installed (scripts/setup.sh test installs it)")
    command = Path(sys.executable).parent / "evalplus.evaluate"
    assert command.is_file(), f"{command} is missing although evalplus is installed"
    # `-- --help`: Fire's help flag (a bare --help is taken as evaluate()'s missing DATASET: exit 2)
    proc = subprocess.run([str(command), "--", "--help"], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "DATASET" in proc.stdout + proc.stderr  # evaluate()'s arguments, as Fire lists them
