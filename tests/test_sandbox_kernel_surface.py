"""The sandboxed program gets no namespaces, mounts or root changes, and no more wall time than stated.

A user namespace would hand the program every capability inside it (mount, chroot, and kernel code
unprivileged users do not otherwise reach); the seccomp filter (gates/sandbox/syscall_filter.py)
refuses it. The wall-clock limit is hard: the harness SIGKILLs the process group at it, whatever
the program does with its signals.
"""

from __future__ import annotations

import importlib.util
import json
import platform
import sys
import time
from pathlib import Path

import pytest

from onecat.gates.sandbox import SandboxLimits, probe_isolation, run_python
from onecat.gates.sandbox import syscall_filter

pytestmark = pytest.mark.skipif(platform.system() != "Linux", reason="the sandbox's OS layer is Linux's")

LIMITS = SandboxLimits(cpu_s=5, wall_s=10, memory_bytes=512 << 20, max_processes=8)
WALL_MARGIN_S = 1.0   # polling, process teardown and a loaded machine; far below the 18 s seen unbounded

# Every attempt reports "OK" or the errno name; the program never dies on a refusal.
ESCAPES = r'''
import ctypes, errno, json, os, struct
libc = ctypes.CDLL(None, use_errno=True)
CLONE_NEWNS, CLONE_NEWUSER, SIGCHLD = 0x00020000, 0x10000000, 17
SYS_clone, SYS_clone3 = 56, 435
out = {}

def record(name, rc):
    out[name] = "OK" if rc >= 0 else errno.errorcode[ctypes.get_errno()]

def os_unshare(flags):
    try:
        os.unshare(flags)
        return "OK"
    except AttributeError:
        return "absent"      # Python < 3.12
    except OSError as exc:
        return errno.errorcode[exc.errno]

# clones first: a process that has chrooted may not create a user namespace at all
pid = libc.syscall(ctypes.c_long(SYS_clone), ctypes.c_ulong(CLONE_NEWUSER | SIGCHLD), None, None, None, None)
if pid == 0:
    os._exit(0)              # the child of a clone that should not have happened
record("clone(NEWUSER)", pid)
if pid > 0:
    os.waitpid(pid, 0)
args = ctypes.create_string_buffer(struct.pack("=11Q", CLONE_NEWUSER, 0, 0, 0, SIGCHLD, 0, 0, 0, 0, 0, 0))
pid = libc.syscall(ctypes.c_long(SYS_clone3), args, ctypes.c_size_t(88))
if pid == 0:
    os._exit(0)
record("clone3(NEWUSER)", pid)
if pid > 0:
    os.waitpid(pid, 0)
out["os.unshare(NEWUSER)"] = os_unshare(getattr(os, "CLONE_NEWUSER", CLONE_NEWUSER))
out["os.unshare(NEWNS)"] = os_unshare(getattr(os, "CLONE_NEWNS", CLONE_NEWNS))
record("unshare(NEWUSER)", libc.unshare(CLONE_NEWUSER))   # first: inside one, the rest would be allowed
record("unshare(NEWNS)", libc.unshare(CLONE_NEWNS))
record("mount(tmpfs)", libc.mount(b"tmpfs", b"/tmp", b"tmpfs", ctypes.c_ulong(0), None))
record("chroot", libc.chroot(b"/tmp"))
record("setns", libc.setns(0, 0))
print(json.dumps(out))
'''

ORDINARY_PROCESSES = r'''
import os, subprocess, sys, threading
seen = []
worker = threading.Thread(target=seen.append, args=("thread",))
worker.start()
worker.join()
pid = os.fork()
if pid == 0:
    os._exit(7)
seen.append(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
seen.append(subprocess.run([sys.executable, "-c", "print(5)"], capture_output=True).stdout.decode().strip())
print(seen)
'''

IGNORES_ALARM = ("import signal\n"
                 "for sig in (signal.SIGALRM, signal.SIGXCPU, signal.SIGTERM, signal.SIGINT):\n"
                 "    signal.signal(sig, signal.SIG_IGN)\n"
                 "signal.setitimer(signal.ITIMER_REAL, 0.1, 0.1)\n"
                 "while True:\n    pass\n")

CATCHES_TIMEOUT = ("import signal\n"
                   "def _raise(*_):\n    raise TimeoutError\n"
                   "signal.signal(signal.SIGALRM, _raise)\n"
                   "signal.setitimer(signal.ITIMER_REAL, 0.1, 0.1)\n"
                   "while True:\n"
                   "    try:\n        while True:\n            pass\n"
                   "    except BaseException:\n        pass\n")


def _needs_filter() -> None:
    reason = syscall_filter.unsupported_reason()
    if reason:
        pytest.skip(f"no namespace filter on this machine: {reason}")


def _escapes(limits: SandboxLimits) -> dict:
    res = run_python(ESCAPES, limits, guard="off")
    assert res.ok, res.stderr_text
    return json.loads(res.stdout_text)


def test_program_cannot_create_namespaces_mount_or_chroot():
    _needs_filter()
    got = _escapes(LIMITS)
    for name in ("unshare(NEWNS)", "unshare(NEWUSER)", "mount(tmpfs)", "chroot", "setns", "clone(NEWUSER)"):
        assert got[name] == "EPERM", (name, got)
    assert got["clone3(NEWUSER)"] == "ENOSYS", got     # libc falls back to clone, which is checked
    for name in ("os.unshare(NEWUSER)", "os.unshare(NEWNS)"):
        assert got[name] in ("EPERM", "absent"), (name, got)
    assert "seccomp:no-namespaces" in probe_isolation()["mechanisms"]


def test_without_the_filter_the_same_program_gets_a_user_namespace():
    """The control: what the filter takes away is really there on this kernel (else the test above
    would prove nothing), and switching the filter off is stated in the run's notes."""
    _needs_filter()
    limits = SandboxLimits(**{**LIMITS.to_dict(), "deny_namespaces": False})
    res = run_python(ESCAPES, limits, guard="off")
    assert res.ok, res.stderr_text
    assert "seccomp:no-namespaces" not in res.mechanisms
    assert any("namespace filter disabled" in note for note in res.notes), res.notes
    got = json.loads(res.stdout_text)
    if got["unshare(NEWUSER)"] != "OK":
        pytest.skip(f"this kernel refuses user namespaces to the sandbox uid anyway: {got}")
    assert got["clone(NEWUSER)"] == "OK" and got["clone3(NEWUSER)"] == "OK", got
    assert got["mount(tmpfs)"] == "OK" or got["chroot"] == "OK", got


def test_threads_fork_and_subprocess_still_work_under_the_filter():
    res = run_python(ORDINARY_PROCESSES, LIMITS, guard="off")
    assert res.ok, res.stderr_text
    assert res.stdout_text.strip() == "['thread', 7, '5']"


def test_a_syscall_from_the_x32_abi_kills_the_program():
    _needs_filter()
    prog = "import ctypes\nctypes.CDLL(None).syscall(ctypes.c_long(0x40000000 + 39))\nprint('survived')\n"
    res = run_python(prog, LIMITS, guard="off")
    assert res.signal == 31 and "survived" not in res.stdout_text, (res.describe(), res.stdout_text)  # SIGSYS


def test_the_filter_declines_other_architectures_with_a_reason():
    assert syscall_filter.unsupported_reason("x86_64") is None
    assert "aarch64" in syscall_filter.unsupported_reason("aarch64")


@pytest.fixture()
def launcher(monkeypatch):
    """launcher.py as a module (it is a script: it puts its folder on sys.path and imports its siblings
    by file name; both are undone afterwards)."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    before = set(sys.modules)
    spec = importlib.util.spec_from_file_location("sandbox_launcher_under_test",
                                                  Path(syscall_filter.__file__).with_name("launcher.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    yield module
    for name in set(sys.modules) - before:
        if name in ("fresh_root", "syscall_filter"):
            del sys.modules[name]


def test_a_missing_filter_is_reported_not_silent(launcher, monkeypatch):
    """On a machine without the filter the run says so: the launcher turns install()'s reason into a note."""
    monkeypatch.setattr(launcher.syscall_filter, "install", lambda: "no syscall table for riscv64 (only x86_64)")
    mechanisms, notes = [], []
    launcher._deny_namespaces({"limits": LIMITS.to_dict()}, mechanisms, notes)
    assert mechanisms == [] and "namespace filter not applied (no syscall table for riscv64" in notes[0], notes


@pytest.mark.parametrize("program", [IGNORES_ALARM, CATCHES_TIMEOUT], ids=["ignores-signals", "catches-timeout"])
def test_busy_loop_is_killed_at_the_stated_wall_limit(program):
    limits = SandboxLimits(cpu_s=60, wall_s=2.0)   # CPU limit far away: only the wall limit can end it
    start = time.monotonic()
    res = run_python(program, limits, guard="off")
    elapsed = time.monotonic() - start
    assert res.timed_out and not res.ok, res.describe()
    assert res.wall_limit_s == 2.0 and "2 s, process group killed" in res.describe()
    assert res.wall_s <= limits.wall_s + WALL_MARGIN_S, res.wall_s
    assert elapsed <= limits.wall_s + WALL_MARGIN_S + 1.0, elapsed   # result collection included


def test_cpu_limit_backstops_the_wall_limit():
    """RLIMIT_CPU is min(cpu_s, wall_s) (hard = soft + 1 s), so a program ignoring SIGXCPU still dies
    by SIGKILL should the wall kill ever not come."""
    show = "import resource\nprint(resource.getrlimit(resource.RLIMIT_CPU))\n"
    res = run_python(show, SandboxLimits(cpu_s=60, wall_s=3), guard="off")
    assert res.ok and res.stdout_text.strip() == "(3, 4)", (res.stdout_text, res.stderr_text)
    prog = "import signal\nsignal.signal(signal.SIGXCPU, signal.SIG_IGN)\nwhile True:\n    pass\n"
    res = run_python(prog, SandboxLimits(cpu_s=1, wall_s=30), guard="off")
    assert not res.ok and not res.timed_out and res.signal == 9, res.describe()


@pytest.mark.parametrize("guard", ["off", "before"])
def test_ordinary_programs_keep_their_verdicts(guard):
    passing = run_python("assert sorted([3, 1, 2]) == [1, 2, 3]\nprint('pass')\n", LIMITS, guard=guard)
    assert passing.ok and passing.stdout_text.strip() == "pass" and not passing.timed_out, passing.stderr_text
    assert passing.wall_limit_s == LIMITS.wall_s
    failing = run_python("assert sorted([3, 1, 2]) == [3, 2, 1]\nprint('pass')\n", LIMITS, guard=guard)
    assert not failing.ok and failing.exit_code == 1 and "AssertionError" in failing.stderr_text
    assert "pass" not in failing.stdout_text
