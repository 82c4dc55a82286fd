"""Packages for sandboxed code: the third-party modules EvalPlus's environment has (numpy).

The sandbox runs a system interpreter readable by an unprivileged uid (the project's venv usually
is not), and such an interpreter rarely has numpy; a solution that imports it would then fail where
EvalPlus passes it. `provision()` installs the wheels for that interpreter's Python version into a
world-readable folder outside the project, home, data and cache trees (`site_dir`), and the sandbox
puts that folder, read-only, on the program's sys.path. Nothing from the harness goes in there.
"""
from __future__ import annotations

import os
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

PACKAGES = ("numpy",)  # what EvalPlus's evaluation environment offers generated code beyond the stdlib
PRIVATE_IN_SANDBOX = ("/tmp", "/var/tmp", "/dev/shm")  # the sandbox mounts its own there: never a site


def default_root() -> Path:
    """/opt/onecat/sandbox-site where this user may write there (root), else under ~/.local/share."""
    opt = Path("/opt")
    if os.access(opt, os.W_OK) or os.access(opt / "onecat", os.W_OK):
        return opt / "onecat" / "sandbox-site"
    return Path.home() / ".local" / "share" / "onecat" / "sandbox-site"


@lru_cache(maxsize=None)
def python_version(python: str) -> str | None:
    """'3.11' for an interpreter, or None when it does not start."""
    try:
        out = subprocess.run([python, "-I", "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                             capture_output=True, timeout=30, stdin=subprocess.DEVNULL, cwd="/")
        return out.stdout.decode().strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def site_dir(python: str) -> Path | None:
    """The package folder for `python` ($ONECAT_SANDBOX_SITE or default_root(), one subfolder per Python
    version), or None when the version is unknown. A folder under a path the sandbox makes private
    (/tmp, /var/tmp, /dev/shm) would be invisible inside it: refused with the reason."""
    version = python_version(python)
    if version is None:
        return None
    root = Path(os.environ.get("ONECAT_SANDBOX_SITE") or default_root()).resolve()
    if any(root == Path(p) or Path(p) in root.parents for p in PRIVATE_IN_SANDBOX):
        raise ValueError(f"ONECAT_SANDBOX_SITE={root} is under {', '.join(PRIVATE_IN_SANDBOX)}, which the sandbox "
                         "replaces with its own empty folders; choose a folder elsewhere (e.g. /opt/onecat)")
    return root / f"py{version}"


def provisioned(python: str) -> Path | None:
    """The folder when it holds every package (a marker written after a complete install), else None."""
    folder = site_dir(python)
    return folder if folder is not None and (folder / ".complete").is_file() else None


def provision(python: str) -> Path:
    """Install PACKAGES (binary wheels for `python`'s version) into site_dir(python), readable by all."""
    folder = site_dir(python)
    if folder is None:
        raise RuntimeError(f"cannot tell the Python version of {python}")
    if (folder / ".complete").is_file():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                    "--target", str(folder), "--only-binary=:all:", "--python-version", folder.name[2:],
                    "--no-deps", *PACKAGES], check=True)
    for root, dirs, files in os.walk(folder):
        for name in dirs:
            os.chmod(os.path.join(root, name), 0o755)
        for name in files:
            os.chmod(os.path.join(root, name), 0o644 | (os.stat(os.path.join(root, name)).st_mode & 0o111))
    for d in (folder.parent, folder):  # the levels made here (the sandbox binds the folder itself)
        os.chmod(d, 0o755)
    (folder / ".complete").write_text(" ".join(PACKAGES) + "\n")
    return folder
