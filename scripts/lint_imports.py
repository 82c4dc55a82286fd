"""Checks onecat's import layering: the import-linter contracts in pyproject.toml ([tool.importlinter])
and, beyond them, no import cycle between any two modules anywhere in onecat, deferred (function-level)
imports included (import-linter's `acyclic_siblings` contract does not see a cycle that runs through a
package's own __init__, nor one outside the packages it is pointed at).

grimp cannot find `onecat` through the editable install (setup.py maps the top-level folders into
the namespace with a path-hook finder), so the check runs in a child process whose PYTHONPATH holds
a folder `onecat/` of symlinks to the folders.

    .venv/bin/python scripts/lint_imports.py              # this repository
    .venv/bin/python scripts/lint_imports.py --root DIR   # another tree holding engine/, gates/, ...

Exit status 0 when every contract is kept and no cycle is found, 1 otherwise.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "gates", "results", "reports", "cli", "training")
CYCLE_FREE = "onecat"


def namespace_tree(root: Path, dest: Path) -> Path:
    """dest/onecat/<folder> -> root/<folder> for each package folder; returns dest (for PYTHONPATH)."""
    namespace = dest / "onecat"
    namespace.mkdir(parents=True)
    for name in PACKAGES:
        folder = root / name
        if not (folder / "__init__.py").is_file():
            raise SystemExit(f"{folder} is not a package folder; pass --root the folder that holds "
                             f"{', '.join(PACKAGES)}")
        (namespace / name).symlink_to(folder, target_is_directory=True)
    return dest


def module_cycles(graph, package: str) -> list[tuple[str, ...]]:
    """Each import cycle among package's modules (the package itself included), reported once per set
    of modules as importer -> ... -> importer."""
    modules = {package} | graph.find_descendants(package)
    seen, cycles = set(), []
    for importer in sorted(modules):
        for imported in sorted(graph.find_modules_directly_imported_by(importer) & modules):
            back = graph.find_shortest_chain(importer=imported, imported=importer)
            if back and frozenset(back) not in seen:
                seen.add(frozenset(back))
                cycles.append((importer, *back))
    return cycles


def check_inside_tree(config: Path) -> int:
    """The check itself; runs where `onecat` resolves to the symlink tree."""
    try:
        import grimp
        from importlinter.cli import lint_imports
    except ImportError as exc:
        raise SystemExit(f"{exc}: install the test extras (scripts/setup.sh test, or pip install import-linter)")

    kept = lint_imports(config_filename=str(config), no_cache=True, no_logo=True) == 0
    cycles = module_cycles(grimp.build_graph("onecat", cache_dir=None), CYCLE_FREE)
    for cycle in cycles:
        print(f"import cycle in {CYCLE_FREE}: {' -> '.join(cycle)}")
    if not cycles:
        print(f"no import cycle between the modules of {CYCLE_FREE}")
    return 0 if kept and not cycles else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=REPO, help="folder holding engine/, gates/, results/, ...")
    parser.add_argument("--config", type=Path, default=REPO / "pyproject.toml",
                        help="file with the [tool.importlinter] contracts")
    parser.add_argument("--inside-tree", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.inside_tree:
        return check_inside_tree(args.config)
    if not args.config.is_file():
        raise SystemExit(f"{args.config} does not exist; pass --config the pyproject.toml with the contracts")
    with tempfile.TemporaryDirectory(prefix="onecat-lint-") as tmp:
        tree = namespace_tree(args.root.resolve(), Path(tmp))
        path = os.pathsep.join(p for p in (str(tree), os.environ.get("PYTHONPATH")) if p)
        child = [sys.executable, str(Path(__file__).resolve()), "--inside-tree", "--config", str(args.config.resolve())]
        return subprocess.run(child, env={**os.environ, "PYTHONPATH": path}, cwd=tmp).returncode


if __name__ == "__main__":
    sys.exit(main())
