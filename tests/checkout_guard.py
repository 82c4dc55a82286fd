"""A test run leaves the checkout as it found it: every file a test writes belongs under a temporary folder.

Registered by conftest in the controlling process only (with pytest-xdist, the workers' files are seen
there too): it lists the checkout's untracked and git-ignored files when the session starts and again
when it ends, and fails the session (exit status 1) naming each file that appeared. What the set-up
and the test tools keep in the checkout is not counted: the venv and the package's build metadata
(scripts/setup.sh), bytecode and pytest's own cache (Hypothesis keeps its cache beside the engine's,
tests/conftest.py). `-p no:onecat_checkout_guard`
turns the check off (for a pytest run started inside a test, whose outer run is still writing).
"""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

PLUGIN_NAME = "onecat_checkout_guard"
CHECKOUT = Path(__file__).resolve().parents[1]
# git pathspecs of what the set-up and the test tools keep in the checkout
NOT_TEST_OUTPUT = (".venv", ":(glob)*.egg-info/**", "build", ":(glob)**/__pycache__/**", ".pytest_cache")


def untracked_files(checkout: Path = CHECKOUT) -> set[str] | None:
    """The checkout's untracked and ignored files (paths relative to it), or None where it is not a git
    checkout or git is missing: then there is nothing to compare."""
    excludes = [f":(exclude){spec}" if not spec.startswith(":(") else f":(exclude,{spec[2:]}" for spec in
                NOT_TEST_OUTPUT]
    try:
        proc = subprocess.run(["git", "status", "--porcelain", "-z", "--ignored", "--untracked-files=all", "--",
                               ".", *excludes], cwd=checkout, capture_output=True, timeout=120)
    except (OSError, subprocess.SubprocessError):
        return None
    if proc.returncode != 0:
        return None
    entries = proc.stdout.decode("utf-8", "surrogateescape").split("\0")
    return {entry[3:] for entry in entries if entry[:3] in ("?? ", "!! ")}


class CheckoutGuard:
    def __init__(self, checkout: Path) -> None:
        self.checkout = checkout
        self.before: set[str] | None = None
        self.added: list[str] = []

    def pytest_sessionstart(self, session: pytest.Session) -> None:
        if not session.config.option.collectonly:  # no test runs
            self.before = untracked_files(self.checkout)

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        if self.before is None or exitstatus not in (pytest.ExitCode.OK, pytest.ExitCode.TESTS_FAILED):
            return
        after = untracked_files(self.checkout)
        self.added = sorted((after or set()) - self.before)
        if self.added:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if not self.added:
            return
        shown = self.added[:20] + ([f"... and {len(self.added) - 20} more"] if len(self.added) > 20 else [])
        terminalreporter.section("files the tests left in the checkout", sep="=", red=True, bold=True)
        terminalreporter.write_line(f"{len(self.added)} untracked or ignored file(s) appeared under {self.checkout} "
                                    "during the run (a file saved by hand meanwhile counts too); a test must write "
                                    "under tmp_path, or where an environment variable set in tests/conftest.py "
                                    "points:")
        for path in shown:
            terminalreporter.write_line(f"  {path}")


def register(config: pytest.Config, checkout: Path = CHECKOUT) -> None:
    """In the controlling process only: an xdist worker sees only its own share of the run."""
    if hasattr(config, "workerinput") or config.pluginmanager.is_blocked(PLUGIN_NAME):
        return
    config.pluginmanager.register(CheckoutGuard(checkout), PLUGIN_NAME)
