"""Each pinned revision checked out once, as a detached git worktree under `.onecat/worktrees/<commit>`,
and an import folder per source tree that makes `import onecat.engine` load that tree's engine.

A cached worktree is reused when it is intact (its HEAD is the commit and no tracked file was changed);
otherwise it is removed and checked out again. A lock file keeps two runs from racing on the cache.
"""
from __future__ import annotations

import fcntl
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from onecat.gates.revision.errors import RevisionError
from onecat.gates.revision.repository import git

CACHE = Path(".onecat") / "worktrees"


def cache_dir(repo: Path) -> Path:
    return repo / CACHE


@contextmanager
def _locked(folder: Path) -> Iterator[None]:
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _intact(path: Path, commit: str) -> bool:
    if not (path / ".git").exists():
        return False
    try:
        return (git(path, "rev-parse", "HEAD") == commit
                and git(path, "status", "--porcelain", "--untracked-files=no") == "")
    except RevisionError:
        return False


def materialize(repo: Path, commit: str) -> Path:
    """The worktree of `commit` (checked out on first use, reused while intact)."""
    root = cache_dir(repo)
    path = root / commit
    with _locked(root):
        if _intact(path, commit):
            return path
        if path.exists():  # broken or edited: start over
            try:
                git(repo, "worktree", "remove", "--force", str(path))
            except RevisionError:
                shutil.rmtree(path, ignore_errors=True)
        git(repo, "worktree", "prune")
        try:
            git(repo, "worktree", "add", "--detach", "--quiet", str(path), commit)
        except RevisionError as exc:
            raise RevisionError(f"commit {commit[:12]} could not be checked out as a worktree: {exc}") from None
        if not _intact(path, commit):
            raise RevisionError(f"the worktree of {commit[:12]} at {path} is not at that commit after checkout")
    return path


def import_root(repo: Path, source: Path, name: str) -> Path:
    """A folder to put first on a worker's sys.path so that `onecat.<folder>` is `source/<folder>`: a regular
    `onecat` package (it wins over the installed namespace and the editable install's finder) whose
    entries are symlinks to the top-level folders of `source`."""
    root = cache_dir(repo) / "import" / name
    pkg = root / "onecat"
    wanted = {f.name: f.resolve() for f in source.iterdir() if f.is_dir() and not f.name.startswith((".", "_"))}
    with _locked(cache_dir(repo)):
        have = {f.name: f.resolve() for f in pkg.iterdir() if f.is_symlink()} if pkg.is_dir() else {}
        if have == wanted and (pkg / "__init__.py").is_file():
            return root  # in use by other runs' workers: left as it is
        shutil.rmtree(root, ignore_errors=True)
        pkg.mkdir(parents=True)
        (pkg / "__init__.py").write_text(f'"""onecat, imported from {source} by a revision worker."""\n')
        for folder_name, target in sorted(wanted.items()):
            (pkg / folder_name).symlink_to(target, target_is_directory=True)
    return root
