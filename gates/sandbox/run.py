"""Harness side of the sandbox: scratch dir, launch, deadline, group kill, capped output capture.

Containment, in the order the kernel enforces it (see launcher.py for the process tree):
  * its own session/process group, SIGKILLed as a whole at the end or at the hard wall-clock limit
    (`SandboxLimits.wall_s`, counted from the launch and stated in every result as `wall_limit_s`);
  * when the harness runs as root: a fresh unprivileged uid per run (RLIMIT_NPROC is counted per
    uid and ignored for root, so a private uid is what makes the process cap real; it also removes
    write access to every file it does not own);
  * pid, network, mount, ipc and uts namespaces where the OS allows (a pid namespace dies with its
    init; the network namespace has only a downed loopback; /tmp, /var/tmp, /dev/shm are private);
  * a fresh root filesystem (fresh_root.py): the interpreter and its libraries read-only, /dev
    nodes, a private /tmp and the scratch dir; no data dir, no work folder or caches, no project
    tree, no home. Without a mount namespace the program sees the host filesystem as its own uid
    ("host-fs-view"), and only file permissions (0700 harness caches) protect what it must not read;
  * rlimits: CPU, address space, processes, file size, open files, no core dumps;
  * a seccomp filter (syscall_filter.py): no user or other namespace, no mount, no chroot; where it
    cannot be installed the run's notes say why (`seccomp:no-namespaces` in mechanisms when it is);
  * a minimal environment: never the harness's variables;
  * bounded capture: stdout/stderr keep max_output_bytes and drop the rest as it streams; the
    optional result channel (fd 3) is read line by line under its own cap (capture.py);
  * inside the interpreter, EvalPlus's reliability guard and a blocked socket layer.

Why this combination (probed where the harness runs as root in a VM, kernel 6.x, 2 cores):
RLIMIT_NPROC alone does not stop a root fork bomb (root bypasses it), so the program gets its own
uid; `unshare` of pid/net/mount namespaces succeeds there, which gives a kill-everything-on-exit
pid namespace, a network with no route out, and private /tmp and /proc (the harness's
/proc/<pid>/environ is not even visible). A private uid still reads every world-readable file
(a solution could open the dataset and exec its canonical solution, or replay a reference
cache), so the program also gets a fresh root; pivot_root works there. A writable cgroup-v1 pids controller was also present,
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
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from onecat.gates.sandbox.capture import CappedPipe, Channel, LineReader
from onecat.gates.sandbox.interpreter import interpreter_candidates, root_paths, vet_paths, world_executable
from onecat.gates.sandbox.limits import SandboxLimits
from onecat.gates.sandbox.site import provisioned

_HERE = Path(__file__).resolve().parent
_LAUNCHER = _HERE / "launcher.py"
_BOOTSTRAP_SOURCE = (_HERE / "bootstrap.py").read_text(encoding="utf-8")
_UID_BASE = 1_600_000_000          # far above any real account; one fresh uid per sandbox run
_uid_counter = itertools.count()
_uid_lock = threading.Lock()
HOST_VIEW_NOTE = {
    True: ("no fresh root: the program sees the host filesystem as an unprivileged uid; harness caches "
           "are 0700, but world-readable files (e.g. a shared data dir) stay readable"),
    False: ("no fresh root and no uid switch (harness not root): the program can read whatever the "
            "harness user can, its caches included"),
}


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
    stopped: bool = False                 # the channel's consumer stopped the program early
    wall_limit_s: float | None = None     # the hard wall-clock limit it ran under (SIGKILL of the group)
    channel_error: str | None = None      # the channel's consumer raised (reported, not re-raised)

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
            limit = f" ({self.wall_limit_s:g} s, process group killed)" if self.wall_limit_s else ""
            return f"wall-time limit exceeded{limit}"
        if self.stopped:
            return "stopped by the harness once the result was known"
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


def _minimal_env(scratch: str) -> dict[str, str]:
    return {"PATH": "/usr/bin:/bin", "HOME": scratch, "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8",
            "PYTHONHASHSEED": "0", "PYTHONDONTWRITEBYTECODE": "1", "PYTHONIOENCODING": "utf-8",
            "OMP_NUM_THREADS": "1", "TMPDIR": "/tmp"}


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


def _write_files(scratch: str, files: dict[str, bytes | str]) -> None:
    for name, content in files.items():
        target = Path(scratch) / name
        if target.resolve().parent != Path(scratch).resolve():
            raise ValueError(f"sandbox file name {name!r} must be a plain file name")
        target.write_bytes(content.encode("utf-8") if isinstance(content, str) else content)
        os.chmod(target, 0o644)


def _wait(proc: subprocess.Popen, deadline: float, stop: threading.Event) -> tuple[bool, bool]:
    """Wait for the launcher; SIGKILL its whole group at the deadline or when the channel consumer
    asks (the group id is still ours: the launcher is not reaped yet). (timed_out, stopped)."""
    stopped = False
    while True:
        try:
            proc.wait(timeout=max(0.0, min(0.05, deadline - time.monotonic())))
            return False, stopped
        except subprocess.TimeoutExpired:
            if time.monotonic() >= deadline:
                _kill_group(proc.pid)
                return not stopped, stopped
            if stop.is_set() and not stopped:
                stopped = True
                _kill_group(proc.pid)


def _launch(source: str, limits: SandboxLimits, python: str, files: dict[str, bytes | str] | None,
            stdin: bytes | None, guard: str, channel: Channel | None = None) -> SandboxResult:
    run_as_root = os.geteuid() == 0
    uid = _allocate_uid() if run_as_root else None
    scratch = tempfile.mkdtemp(prefix="onecat-sbx-")
    os.chmod(scratch, 0o755)
    status_r, status_w = os.pipe()
    channel_r, channel_w = os.pipe() if channel is not None else (-1, -1)
    proc = None
    try:
        _write_files(scratch, {**(files or {}), "program.py": source})
        nproc = limits.max_processes if run_as_root else _current_user_processes() + limits.max_processes
        paths, refused = root_paths(python) if limits.fresh_root and limits.namespaces else ((), ())
        env = _minimal_env(scratch)
        site = provisioned(python)  # numpy & co. for the program (site.py), read-only on its sys.path
        if site is not None:
            env["PYTHONPATH"] = str(site)
            if paths:
                paths = (*paths, *vet_paths([str(site)])[0])
        start = time.monotonic()  # the hard limit counts from here: an absolute CLOCK_MONOTONIC deadline
        deadline = start + limits.wall_s
        cfg = {
            "deadline": deadline, "status_fd": status_w, "uid": uid, "namespaces": limits.namespaces, "nproc": nproc,
            "tmpfs_bytes": limits.tmpfs_bytes, "limits": limits.to_dict(), "python": python,
            "bootstrap": _BOOTSTRAP_SOURCE, "program": "program.py", "guard": guard,
            "env": env, "channel_fd": channel_w if channel is not None else None,
            "root_paths": list(paths),
        }
        proc = subprocess.Popen(
            [sys.executable, "-I", str(_LAUNCHER), json.dumps(cfg)], cwd=scratch,
            env=_minimal_env(scratch), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, pass_fds=(status_w,) + ((channel_w,) if channel is not None else ()),
            start_new_session=True, close_fds=True)
        os.close(status_w)
        status_w = -1
        stop = threading.Event()
        readers = [CappedPipe(proc.stdout, limits.max_output_bytes), CappedPipe(proc.stderr, limits.max_output_bytes)]
        if channel is not None:
            os.close(channel_w)
            channel_w = -1
            readers.append(LineReader(channel_r, channel, stop))
        for t in readers:
            t.start()
        try:
            if stdin:
                proc.stdin.write(stdin)
            proc.stdin.close()
        except BrokenPipeError:
            pass
        timed_out, stopped = _wait(proc, deadline, stop)
        wall = time.monotonic() - start
        _kill_group(proc.pid)
        proc.wait()
        status = _read_status(status_r)
        if uid is not None and "pidns" not in status.get("mechanisms", []):
            _kill_uid(uid)
        for t in readers:
            t.join(timeout=5)
        timed_out = timed_out or bool(status.get("timed_out"))
        mechanisms = list(status.get("mechanisms", [])) + ["rlimits", "minimal-env", "killpg"]
        mechanisms += [f"python-guard:{guard}"] if guard != "off" else []
        notes = list(status.get("notes", [])) + [f"not bound into the fresh root (protected): {p}" for p in refused]
        if not any(m.startswith("fresh-root:") for m in mechanisms):
            mechanisms.append("host-fs-view")
            notes.append(HOST_VIEW_NOTE[uid is not None])
        channel_error = None
        if channel is not None and readers[2].error is not None:
            channel_error = f"{type(readers[2].error).__name__}: {readers[2].error}"[:500]
        return SandboxResult(
            exit_code=None if timed_out or stopped else status.get("exit_code"),
            signal=None if timed_out or stopped else status.get("signal"),
            timed_out=timed_out and not stopped, stdout=readers[0].collected(), stderr=readers[1].collected(),
            stdout_truncated=readers[0].truncated, stderr_truncated=readers[1].truncated, wall_s=wall,
            cpu_s=status.get("cpu_s"), mechanisms=mechanisms, notes=notes, uid=uid, stopped=stopped,
            wall_limit_s=limits.wall_s, channel_error=channel_error)
    finally:
        if proc is not None and proc.poll() is None:
            _kill_group(proc.pid)
            proc.wait()
        for fd in (status_w, channel_w):
            if fd >= 0:
                os.close(fd)
        os.close(status_r)
        if channel_r >= 0:
            os.close(channel_r)
        shutil.rmtree(scratch, ignore_errors=True)


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
    status: dict = {}
    for line in b"".join(chunks).splitlines():  # isolation report first, then how the program ended
        try:
            status.update(json.loads(line))
        except (ValueError, TypeError):
            break
    return status


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


@lru_cache(maxsize=1)
def sandbox_python() -> str:
    """First interpreter that starts and imports the stdlib as the sandbox's unprivileged uid."""
    tried = []
    for cand in interpreter_candidates():
        if os.geteuid() == 0 and not world_executable(cand):
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
               stdin: bytes | None = None, guard: str | None = None, channel: Channel | None = None) -> SandboxResult:
    """Run `source` as __main__ in a fresh sandbox; `files` are written into its scratch dir first.

    guard: "before" (default when limits.python_guard) | "manual" (program calls sandbox_harden())
    | "off". channel: the program gets a pipe as fd 3 whose lines stream to `channel.on_line`
    (see capture.Channel). The scratch dir is removed afterwards, whatever the program did.
    """
    limits = limits or SandboxLimits()
    if guard is None:
        guard = "before" if limits.python_guard else "off"
    if guard not in ("before", "manual", "off"):
        raise ValueError(f"guard must be 'before', 'manual' or 'off', got {guard!r}")
    return _launch(source, limits, sandbox_python(), files, stdin, guard, channel)


@lru_cache(maxsize=1)
def probe_isolation() -> dict:
    """What this machine actually gives the sandbox (recorded with results and shown in reports)."""
    res = run_python("print('ok')", SandboxLimits(wall_s=30))
    return {"python": sandbox_python(), "run_as_root": os.geteuid() == 0,
            "mechanisms": res.mechanisms, "notes": res.notes}
