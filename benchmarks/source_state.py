"""Which source a record was measured on: the git revision, and a digest of the engine's source files.

A benchmark often runs on a copy of the working tree whose git metadata may be older than its files (a GPU
machine's copy), so the revision alone can name the wrong tree; the digest (sha256 over the tracked-or-not
`engine/` and `csrc/` files' paths and contents, sorted) names the files that ran. `python
benchmarks/source_state.py` prints both for the tree at hand, to match a record against a commit.
"""
from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCE_DIRS = ("engine", "csrc")
SUFFIXES = (".py", ".cu", ".cuh", ".cpp", ".h")


def source_digest(root: Path = ROOT) -> str:
    h = hashlib.sha256()
    files = sorted(f for d in SOURCE_DIRS for f in (root / d).rglob("*") if f.is_file() and f.suffix in SUFFIXES)
    for f in files:
        h.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def source_state(root: Path = ROOT) -> dict:
    revision = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=root).stdout.strip()
    return {"revision": revision or None, "source_sha256": source_digest(root)}


if __name__ == "__main__":
    print(json.dumps(source_state(), indent=1))
