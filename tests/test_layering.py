"""The import layering of docs/architecture.md holds (scripts/lint_imports.py: the import-linter contracts in
pyproject.toml plus no import cycle between any of onecat's modules), and the check really fails
when a forbidden import or a cycle is added to a copy of the engine or of the harness."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LINT = REPO / "scripts" / "lint_imports.py"


def _lint(root: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(LINT), "--root", str(root)], capture_output=True, text=True,
                          timeout=300)


@pytest.fixture
def engine_copy(tmp_path) -> Path:
    """A tree with a copy of engine/ (to add modules to) beside links to the other package folders."""
    root = tmp_path / "src"
    root.mkdir()
    shutil.copytree(REPO / "engine", root / "engine", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("gates", "results", "reports", "cli", "training"):
        (root / name).symlink_to(REPO / name, target_is_directory=True)
    return root


def test_repository_keeps_the_layering():
    result = _lint()
    assert result.returncode == 0, result.stdout + result.stderr
    assert "BROKEN" not in result.stdout


def test_engine_importing_the_harness_fails(engine_copy):
    (engine_copy / "engine" / "layering_probe.py").write_text("import onecat.gates\n")
    result = _lint(engine_copy)
    assert result.returncode == 1
    assert "engine imports no harness package BROKEN" in result.stdout
    assert "onecat.engine.layering_probe -> onecat.gates" in result.stdout


def test_runtime_engine_importing_kernel_tools_fails(engine_copy):
    (engine_copy / "engine" / "layering_probe.py").write_text("import onecat.engine.kernel_tools.projection\n")
    result = _lint(engine_copy)
    assert result.returncode == 1
    assert "offline kernel tools are imported only by the CLI BROKEN" in result.stdout


def test_cycle_between_engine_modules_fails(engine_copy):
    (engine_copy / "engine" / "probe_a.py").write_text("import onecat.engine.probe_b\n")
    (engine_copy / "engine" / "probe_b.py").write_text("def later():\n    import onecat.engine.probe_a\n")
    result = _lint(engine_copy)
    assert result.returncode == 1
    assert "no import cycles between the modules and subpackages of engine BROKEN" in result.stdout
    assert "import cycle in onecat: onecat.engine.probe_a -> onecat.engine.probe_b -> onecat.engine.probe_a" \
        in result.stdout


def test_cycle_through_a_package_init_fails(engine_copy):
    """import-linter's acyclic_siblings contract does not see this one; the script's own check does."""
    probe = engine_copy / "engine" / "probe_pkg"
    probe.mkdir()
    (probe / "__init__.py").write_text("from onecat.engine.probe_pkg.child import VALUE\n")
    (probe / "child.py").write_text("import onecat.engine.probe_pkg\n\nVALUE = 1\n")
    result = _lint(engine_copy)
    assert result.returncode == 1
    assert ("import cycle in onecat: onecat.engine.probe_pkg -> onecat.engine.probe_pkg.child -> "
            "onecat.engine.probe_pkg") in result.stdout


def test_a_root_without_the_package_folders_is_refused(tmp_path):
    result = _lint(tmp_path)
    assert result.returncode != 0
    assert "is not a package folder; pass --root the folder that holds engine, gates" in result.stderr


def test_core_importing_the_worker_fails(engine_copy):
    (engine_copy / "engine" / "core" / "layering_probe.py").write_text("import onecat.engine.worker.model_runner\n")
    result = _lint(engine_copy)
    assert result.returncode == 1
    assert "the engine core decides: it runs the model only through the worker it is given BROKEN" in result.stdout


def test_deferred_cycle_between_harness_modules_fails(tmp_path):
    """A cycle outside the engine, closed by a function-level import, is found too."""
    root = tmp_path / "src"
    root.mkdir()
    shutil.copytree(REPO / "gates", root / "gates", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("engine", "results", "reports", "cli", "training"):
        (root / name).symlink_to(REPO / name, target_is_directory=True)
    (root / "gates" / "probe_a.py").write_text("import onecat.gates.probe_b\n")
    (root / "gates" / "probe_b.py").write_text("def later():\n    import onecat.gates.probe_a\n")
    result = _lint(root)
    assert result.returncode == 1
    assert "import cycle in onecat: onecat.gates.probe_a -> onecat.gates.probe_b -> onecat.gates.probe_a" in result.stdout
