"""Git queries for revision arms: the repository, a ref's commit, and the working tree's engine changes."""
from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path
from typing import Optional

from onecat.gates.revision.errors import RevisionError

# The folders whose code the engine runs (engine/ imports, csrc/ is compiled on demand): uncommitted changes
# there make the working tree "dirty" and enter its fingerprint.
ENGINE_FOLDERS = ("engine", "csrc")
GIT_TIMEOUT_S = 120


def git(repo: Path, *args: str, binary: bool = False) -> str | bytes:
    """Run git in `repo`; its output, or RevisionError carrying git's own message."""
    try:
        done = subprocess.run(["git", *args], cwd=repo, capture_output=True, timeout=GIT_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError) as exc:
        raise RevisionError(f"git {' '.join(args)} could not run in {repo}: {exc}") from None
    if done.returncode != 0:
        why = done.stderr.decode(errors="replace").strip() or f"exit code {done.returncode}"
        raise RevisionError(f"git {' '.join(args)} failed in {repo}: {why}")
    return done.stdout if binary else done.stdout.decode(errors="replace").strip()


def repo_root(start: Path) -> Path:
    """The top of the git checkout holding `start` (where refs resolve and worktrees are cached)."""
    try:
        return Path(str(git(start, "rev-parse", "--show-toplevel")))
    except RevisionError as exc:
        raise RevisionError(f"pinning engine code to a git revision needs a git checkout: {start} is not inside "
                            f"one ({exc}); run `onecat gate run` from the repository") from None


def resolve_commit(repo: Path, ref: str) -> str:
    """The full commit id `ref` names in `repo`."""
    try:
        return str(git(repo, "rev-parse", "--verify", "--quiet", "--end-of-options", f"{ref}^{{commit}}"))
    except RevisionError:
        raise RevisionError(f"{ref!r} is not a commit in {repo} (no such branch, tag or commit; fetch it first, "
                            "e.g. `git fetch origin main`, or check its spelling)") from None


def dirty_sha256(repo: Path, folders: tuple[str, ...] = ENGINE_FOLDERS) -> Optional[str]:
    """sha256 of the uncommitted changes to `folders` (diff against HEAD plus untracked files, names and
    contents); None when there are none."""
    diff = git(repo, "diff", "HEAD", "--binary", "--", *folders, binary=True)
    untracked = str(git(repo, "ls-files", "--others", "--exclude-standard", "-z", "--", *folders))
    names = sorted(n for n in untracked.split("\0") if n)
    if not diff and not names:
        return None
    h = hashlib.sha256(diff)
    for name in names:
        h.update(b"\0untracked\0" + name.encode() + b"\0")
        h.update((repo / name).read_bytes())
    return h.hexdigest()


def main_checkout(path: Path) -> Path:
    """The checkout a worktree belongs to (`path` itself for the main checkout): where the cache lives."""
    return Path(str(git(path, "rev-parse", "--path-format=absolute", "--git-common-dir"))).parent
