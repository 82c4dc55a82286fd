"""Which interpreter the sandbox runs, and which host paths it needs inside a fresh root.

The fresh root (fresh_root.py) holds only what `root_paths` lists: the interpreter, its ELF loader,
the directories on its sys.path, and the directories of every shared library it maps once all of
its stdlib extension modules are imported. The list is probed by running the interpreter itself
(trusted, minimal environment, isolated mode), once per interpreter, then vetted: a path that is
`/` or contains the harness's project tree, working directory, home, data or cache directory is
refused, so no probe result can expose those.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import struct
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

_PROJECT = Path(__file__).resolve().parents[2]

_PROBE = r"""
import json, os, sys, importlib
for entry in list(sys.path):
    if os.path.basename(entry) == "lib-dynload" and os.path.isdir(entry):
        for name in sorted(os.listdir(entry)):
            if name.endswith(".so"):
                try:
                    importlib.import_module(name.split(".", 1)[0])
                except BaseException:
                    pass
paths = [p for p in sys.path if p and os.path.exists(p)]
if sys.prefix != sys.base_prefix:
    paths.append(os.path.join(sys.prefix, "pyvenv.cfg"))
with open("/proc/self/maps") as fh:
    for line in fh:
        parts = line.split(None, 5)
        mapped = parts[5].rstrip("\n") if len(parts) == 6 else ""
        if mapped.startswith("/") and not mapped.endswith("(deleted)"):
            is_self = mapped == os.path.realpath(sys.executable)
            paths.append(mapped if is_self else os.path.dirname(mapped))
print(json.dumps(sorted(set(paths))))
"""


def world_executable(path: str) -> bool:
    """True when an unprivileged uid can reach and execute `path` (every parent dir o+x)."""
    p = Path(os.path.realpath(path))
    try:
        if not p.stat().st_mode & stat.S_IXOTH:
            return False
        return all(parent.stat().st_mode & stat.S_IXOTH for parent in p.parents)
    except OSError:
        return False


def interpreter_candidates() -> list[str]:
    seen, out = set(), []
    for cand in (os.environ.get("ONECAT_SANDBOX_PYTHON"), sys.executable,
                 getattr(sys, "_base_executable", None), "/usr/bin/python3", "/usr/local/bin/python3",
                 shutil.which("python3")):
        if cand and os.path.exists(cand):
            real = os.path.realpath(cand)
            if real not in seen:
                seen.add(real)
                out.append(real)
    return out


def elf_interpreter(path: str) -> str | None:
    """The program loader an ELF executable names (PT_INTERP), e.g. /lib64/ld-linux-x86-64.so.2."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(64)
            if head[:4] != b"\x7fELF":
                return None
            is64, order = head[4] == 2, "<" if head[5] == 1 else ">"
            if is64:
                (phoff,), (phentsize, phnum) = struct.unpack_from(order + "Q", head, 32), struct.unpack_from(order + "HH", head, 54)
            else:
                (phoff,), (phentsize, phnum) = struct.unpack_from(order + "I", head, 28), struct.unpack_from(order + "HH", head, 42)
            for index in range(phnum):
                fh.seek(phoff + index * phentsize)
                header = fh.read(phentsize)
                if struct.unpack_from(order + "I", header, 0)[0] == 3:  # PT_INTERP
                    offset, size = (struct.unpack_from(order + "QQQQ", header, 8)[::3] if is64
                                    else struct.unpack_from(order + "IIII", header, 4)[::3])
                    fh.seek(offset)
                    return fh.read(size).rstrip(b"\0").decode()
    except (OSError, struct.error, UnicodeDecodeError):
        return None
    return None


def _protected() -> tuple[list[str], list[str]]:
    """(dirs no bind may contain, dirs no bind may contain or lie inside)."""
    not_above = [str(_PROJECT), os.getcwd(), os.path.expanduser("~"), "/root", "/home"]
    nowhere = [str(_PROJECT / ".onecat"), os.path.join(os.getcwd(), ".onecat"),
               *(os.environ[v] for v in ("ONECAT_DATA_DIR", "ONECAT_CACHE_DIR") if os.environ.get(v))]
    real = lambda paths: [os.path.realpath(p) for p in paths]  # noqa: E731
    return real(not_above + nowhere), real(nowhere)


def _contains(outer: str, inner: str) -> bool:
    return inner == outer or inner.startswith(outer.rstrip("/") + "/")


def vet_paths(paths: list[str]) -> tuple[list[str], list[str]]:
    """Split probed paths into (allowed, refused). Refused: `/`, any ancestor of the project, the
    working dir or a home, and anything in or around the data dir, the cache dir or a work folder."""
    not_above, nowhere = _protected()
    allowed, refused = [], []
    for path in paths:
        real = os.path.realpath(path)
        if (real == "/" or any(_contains(real, p) for p in not_above)
                or any(_contains(p, real) for p in nowhere)):
            refused.append(path)
        else:
            allowed.append(path)
    return allowed, refused


@lru_cache(maxsize=None)
def root_paths(python: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(paths to bind into the fresh root, paths refused) for `python`; empty when the probe fails."""
    try:
        proc = subprocess.run([python, "-I", "-c", _PROBE], capture_output=True, timeout=60, cwd="/",
                              stdin=subprocess.DEVNULL, env={"PATH": "/usr/bin:/bin", "LC_ALL": "C.UTF-8"})
        probed = json.loads(proc.stdout.decode().strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return (), ()
    loader = elf_interpreter(python)
    allowed, refused = vet_paths(list(dict.fromkeys([python] + ([loader] if loader else []) + probed)))
    return tuple(allowed), tuple(refused)
