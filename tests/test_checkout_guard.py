"""tests/checkout_guard.py: a pytest run, with or without xdist workers, fails when its tests leave a file
in the checkout, and names the file; the set-up's and the test tools' own files do not count."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.checkout_guard import untracked_files

CHECKOUT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")

CONFTEST = """
from pathlib import Path

from tests import checkout_guard


def pytest_configure(config):
    checkout_guard.register(config, Path(__file__).parent)
"""
TESTS = """
from pathlib import Path

HERE = Path(__file__).parent


def test_writes_into_the_checkout():
    (HERE / ".onecat" / "reports").mkdir(parents=True, exist_ok=True)
    (HERE / ".onecat" / "reports" / "left-behind.md").write_text("x")


def test_writes_what_does_not_count():
    (HERE / "pkg" / "__pycache__").mkdir(parents=True, exist_ok=True)
    (HERE / "pkg" / "__pycache__" / "m.pyc").write_bytes(b"")
    (HERE / ".pytest_cache").mkdir(exist_ok=True)
    (HERE / ".pytest_cache" / "db").write_text("x")


def test_writes_under_tmp_path(tmp_path):
    (tmp_path / "fine.txt").write_text("x")
"""


def _repo(tmp_path: Path, tests: str) -> Path:
    repo = tmp_path / "repo"
    repo.mkdir()
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    (repo / ".gitignore").write_text(".onecat/\n__pycache__/\n.pytest_cache/\n")
    (repo / "conftest.py").write_text(CONFTEST)
    (repo / "test_outputs.py").write_text(tests)
    return repo


def _pytest(repo: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(CHECKOUT)}
    env.pop("PYTEST_XDIST_WORKER", None)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
                          cwd=repo, env=env, capture_output=True, text=True, timeout=300)


def test_untracked_and_ignored_files_are_listed_but_not_the_tools_own(tmp_path):
    repo = _repo(tmp_path, TESTS)
    before = untracked_files(repo)
    assert before == {".gitignore", "conftest.py", "test_outputs.py"}
    (repo / ".onecat").mkdir()
    (repo / ".onecat" / "results.duckdb").write_text("")
    (repo / ".venv" / "bin").mkdir(parents=True)
    (repo / ".venv" / "bin" / "python").write_text("")
    (repo / "onecat.egg-info").mkdir()
    (repo / "onecat.egg-info" / "PKG-INFO").write_text("")
    assert untracked_files(repo) - before == {".onecat/results.duckdb"}
    assert untracked_files(tmp_path / "not-a-repo-at-all") is None


@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["one process", "xdist"])
def test_a_run_that_leaves_a_file_in_the_checkout_fails_and_names_it(tmp_path, workers):
    result = _pytest(_repo(tmp_path, TESTS), *workers)
    out = result.stdout + result.stderr
    assert "3 passed" in out, out[-3000:]
    assert result.returncode == 1, out[-3000:]
    assert "files the tests left in the checkout" in out and ".onecat/reports/left-behind.md" in out
    assert "m.pyc" not in out and ".pytest_cache" not in out


def test_a_run_that_writes_only_under_tmp_path_passes(tmp_path):
    result = _pytest(_repo(tmp_path, TESTS), "-k", "tmp_path")
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    assert "left in the checkout" not in result.stdout
