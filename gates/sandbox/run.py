"""Harness side of the sandbox: scratch dir, launch, deadline, group kill, capped output capture.

Containment, in the order the kernel enforces it (see launcher.py for the process tree):
  * its own session/process group, SIGKILLed as a whole at the end or at the wall deadline;
  * when the harness runs as root: a fresh unprivileged uid per run (RLIMIT_NPROC is counted per
    uid and ignored for root, so a private uid is what makes the process cap real; it also removes
    write access to every file it does not own);
  * pid, network, mount, ipc and uts namespaces where the OS allows (a pid namespace dies with its
    init; the network namespace has only a downed loopback; /tmp, /var/tmp, /dev/shm are private);
  * rlimits: CPU, address space, processes, file size, open files, no core dumps;
  * a minimal environment: never the harness's variables;
  * inside the interpreter, EvalPlus's reliability guard and a blocked socket layer.

Why this combination (probed where the harness runs as root in a VM, kernel 6.x, 2 cores):
RLIMIT_NPROC alone does not stop a root fork bomb (root bypasses it), so the program gets its own
uid; `unshare` of pid/net/mount namespaces succeeds there, which gives a kill-everything-on-exit
pid namespace, a network with no route out, and private /tmp and /proc (the harness's
/proc/<pid>/environ is not even visible). A writable cgroup-v1 pids controller was also present,
but cgroups are not portable (v2 needs delegation) and the per-uid NPROC limit already caps the
process count. The venv's interpreter lived under /root (mode 0700), unreadable to the sandbox
uid, so the interpreter is chosen by probing (`sandbox_python`): the first python3 that starts as
the sandbox uid, e.g. /usr/bin/python3 (override with ONECAT_SANDBOX_PYTHON). Where namespaces
are refused (unprivileged containers) the run records that and falls back to uid + rlimits +
guard (+ a kill of every process of the sandbox uid); as a non-root user there is no uid switch,
and RLIMIT_NPROC counts the user's own processes, so it is set to current + max_processes.
Each run's `mechanisms` lists what was actually applied.
"""

from __future__ import annotations

import itertools
import json
import os
import select
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from onecat.gates.sandbox.limits import SandboxLimits

_HERE = Path(__file__).resolve().parent
_LAUNCHER = _HERE / "launcher.py"
_BOOTSTRAP_SOURCE = (_HERE / "bootstrap.py").read_text(encoding="utf-8")
_UID_BASE = 1_600_000_000          # far above any real account; one fresh uid per sandbox run
_uid_counter = itertools.count()
_uid_lock = threading.Lock()


class SandboxUnavailable(RuntimeError):
    """The sandbox cannot run programs on this machine (no usable interpreter)."""


@dataclass
class SandboxResult:
    """How one sandboxed program ended, with its captured (capped) output."""

    exit_code: int | None
    signal: int | None
    timed_out: bool
    stdout: bytes
    stderr: bytes
    stdout_truncated: bool
    stderr_truncated: bool
    wall_s: float
    cpu_s: float | None
    mechanisms: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    uid: int | None = None

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out

    @property
    def stdout_text(self) -> str:
        return self.stdout.decode("utf-8", errors="replace")

    @property
    def stderr_text(self) -> str:
        return self.stderr.decode("utf-8", errors="replace")

    def describe(self) -> str:
        if self.timed_out:
            return "wall-time limit exceeded"
        if self.signal is not None:
            name = signal.Signals(self.signal).name if self.signal in signal.valid_signals() else self.signal
            return f"killed by {name}"
        if self.exit_code is None:
            return "sandbox lost the program's status"
        return f"exit code {self.exit_code}"


def _allocate_uid() -> int:
    with _uid_lock:
        n = next(_uid_counter)
    return _UID_BASE + (os.getpid() % 100_000) * 1000 + n % 1000


def _world_executable(path: str) -> bool:
    """True when an unprivileged uid can reach and execute `path` (every parent dir o+x)."""
    p = Path(os.path.realpath(path))
    try:
        if not p.stat().st_mode & stat.S_IXOTH:
            return False
        return all(parent.stat().st_mode & stat.S_IXOTH for parent in p.parents)
    except OSError:
        return False


def _minimal_env(scratch: str) -> dict[str, str]:
    return {"PATH": "/usr/bin:/bin", "HOME": scratch, "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8",
            "PYTHONHASHSEED": "0", "PYTHONDONTWRITEBYTECODE": "1", "PYTHONIOENCODING": "utf-8",
            "OMP_NUM_THREADS": "1", "TMPDIR": "/tmp"}


def _drain(stream, cap: int, sink: dict, key: str) -> None:
    """Read a pipe to EOF keeping at most `cap` bytes; what was read is visible even mid-way."""
    state = sink[key] = {"chunks": [], "kept": 0, "truncated": False}
    while True:
        data = stream.read1(65536) if hasattr(stream, "read1") else stream.read(65536)
        if not data:
            break
        room = cap - state["kept"]
        if room > 0:
            state["chunks"].append(data[:room])
            state["kept"] += min(room, len(data))
        if len(data) > room:
            state["truncated"] = True


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _kill_uid(uid: int) -> None:
    """Without a pid namespace a child may escape the process group (setsid); as its uid, kill(-1)."""
    pid = os.fork()
    if pid == 0:
        try:
            os.setgid(uid)
            os.setuid(uid)
            os.kill(-1, signal.SIGKILL)
        finally:
            os._exit(0)
    os.waitpid(pid, 0)


def _launch(source: str, limits: SandboxLimits, python: str, files: dict[str, bytes | str] | None,
            stdin: bytes | None, guard: str) -> SandboxResult:
    run_as_root = os.geteuid() == 0
    uid = _allocate_uid() if run_as_root else None
    scratch = tempfile.mkdtemp(prefix="onecat-sbx-")
    os.chmod(scratch, 0o755)
    status_r, status_w = os.pipe()
    proc = None
    start = time.monotonic()
    try:
        for name, content in {**(files or {}), "program.py": source}.items():
            target = Path(scratch) / name
            if target.resolve().parent != Path(scratch).resolve():
                raise ValueError(f"sandbox file name {name!r} must be a plain file name")
            target.write_bytes(content.encode("utf-8") if isinstance(content, str) else content)
            os.chmod(target, 0o644)
        nproc = limits.max_processes if run_as_root else _current_user_processes() + limits.max_processes
        cfg = {
            "status_fd": status_w, "uid": uid, "namespaces": limits.namespaces, "nproc": nproc,
            "tmpfs_bytes": limits.tmpfs_bytes, "limits": limits.to_dict(), "python": python,
            "bootstrap": _BOOTSTRAP_SOURCE, "program": "program.py", "guard": guard,
            "env": _minimal_env(scratch),
        }
        proc = subprocess.Popen(
            [sys.executable, "-I", str(_LAUNCHER), json.dumps(cfg)], cwd=scratch,
            env=_minimal_env(scratch), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, pass_fds=(status_w,), start_new_session=True, close_fds=True)
        os.close(status_w)
        status_w = -1
        sink: dict = {}
        readers = [threading.Thread(target=_drain, args=(s, limits.max_output_bytes, sink, k), daemon=True)
                   for s, k in ((proc.stdout, "out"), (proc.stderr, "err"))]
        for t in readers:
            t.start()
        try:
            if stdin:
                proc.stdin.write(stdin)
            proc.stdin.close()
        except BrokenPipeError:
            pass
        timed_out = False
        try:  # the launcher enforces wall_s itself; this is the backstop if it cannot
            proc.wait(timeout=limits.wall_s + 5.0)
        except subprocess.TimeoutExpired:
            timed_out = True
        wall = time.monotonic() - start
        _kill_group(proc.pid)
        proc.wait()
        status = _read_status(status_r)
        if uid is not None and "pidns" not in status.get("mechanisms", []):
            _kill_uid(uid)
        for t in readers:
            t.join(timeout=5)
        out, out_trunc = _collected(sink, "out")
        err, err_trunc = _collected(sink, "err")
        timed_out = timed_out or bool(status.get("timed_out"))
        return SandboxResult(
            exit_code=None if timed_out else status.get("exit_code"),
            signal=None if timed_out else status.get("signal"),
            timed_out=timed_out, stdout=out, stderr=err, stdout_truncated=out_trunc,
            stderr_truncated=err_trunc, wall_s=wall, cpu_s=status.get("cpu_s"),
            mechanisms=list(status.get("mechanisms", [])) + ["rlimits", "minimal-env", "killpg"]
            + ([f"python-guard:{guard}"] if guard != "off" else []),
            notes=list(status.get("notes", [])), uid=uid)
    finally:
        if proc is not None and proc.poll() is None:
            _kill_group(proc.pid)
            proc.wait()
        if status_w >= 0:
            os.close(status_w)
        os.close(status_r)
        shutil.rmtree(scratch, ignore_errors=True)


def _collected(sink: dict, key: str) -> tuple[bytes, bool]:
    state = dict(sink.get(key) or {"chunks": [], "truncated": False})
    return b"".join(list(state["chunks"])), bool(state["truncated"])


def _read_status(fd: int) -> dict:
    chunks = []
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            break
        data = os.read(fd, 65536)
        if not data:
            break
        chunks.append(data)
    try:
        return json.loads(b"".join(chunks) or b"{}")
    except json.JSONDecodeError:
        return {}


def _current_user_processes() -> int:
    uid = os.getuid()
    count = 0
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                count += os.stat(f"/proc/{entry}").st_uid == uid
            except OSError:
                pass
    return count


def _interpreter_candidates() -> list[str]:
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


@lru_cache(maxsize=1)
def sandbox_python() -> str:
    """First interpreter that starts and imports the stdlib as the sandbox's unprivileged uid."""
    tried = []
    for cand in _interpreter_candidates():
        if os.geteuid() == 0 and not _world_executable(cand):
            tried.append(f"{cand} (not reachable by an unprivileged uid)")
            continue
        res = _launch("import json, re, math, collections, itertools, heapq\nprint('ok')",
                      SandboxLimits(wall_s=30), cand, None, None, "before")
        if res.ok and res.stdout_text.strip() == "ok":
            return cand
        tried.append(f"{cand} ({res.describe()}: {res.stderr_text.strip()[-200:]})")
    raise SandboxUnavailable(
        "no Python interpreter can run inside the sandbox. Tried: " + "; ".join(tried)
        + ". Fix: set ONECAT_SANDBOX_PYTHON to a python3 whose files are readable by all users "
        "(for example /usr/bin/python3).")


def run_python(source: str, limits: SandboxLimits | None = None, *, files: dict[str, bytes | str] | None = None,
               stdin: bytes | None = None, guard: str | None = None) -> SandboxResult:
    """Run `source` as __main__ in a fresh sandbox; `files` are written into its scratch dir first.

    guard: "before" (default when limits.python_guard) | "manual" (program calls sandbox_harden())
    | "off". The scratch dir is removed afterwards, whatever the program did.
    """
    limits = limits or SandboxLimits()
    if guard is None:
        guard = "before" if limits.python_guard else "off"
    if guard not in ("before", "manual", "off"):
        raise ValueError(f"guard must be 'before', 'manual' or 'off', got {guard!r}")
    return _launch(source, limits, sandbox_python(), files, stdin, guard)


@lru_cache(maxsize=1)
def probe_isolation() -> dict:
    """What this machine actually gives the sandbox (recorded with results and shown in reports)."""
    res = run_python("print('ok')", SandboxLimits(wall_s=30))
    return {"python": sandbox_python(), "run_as_root": os.geteuid() == 0,
            "mechanisms": res.mechanisms, "notes": res.notes}
