"""Sandbox launcher: isolates, then starts the untrusted program as an unprivileged child.

Executed as a script (`python -I launcher.py CONFIG_JSON`) by the harness with cwd = the scratch
directory; stdlib only and never imported by the harness. Process tree it builds:

    launcher (harness user, own session)
      └─ init   pid 1 of a new pid namespace: mounts a private /proc and tmpfs /tmp, reaps, reports
           └─ program  own mount namespace with a fresh root (fresh_root.py), unprivileged uid,
                       rlimits, no_new_privs, a seccomp filter that denies namespaces, mounts
                       and chroot (syscall_filter.py), exec of the sandbox interpreter

When init exits (program done, or the launcher killed -> PDEATHSIG) the kernel kills every process
left in the pid namespace, so nothing forked by the program can outlive the run. The wall-clock
limit is an absolute CLOCK_MONOTONIC deadline set by the harness: init SIGKILLs the program (and,
without a pid namespace, sweeps its descendants) just before it, and the harness SIGKILLs the whole
process group at it. The program keeps exactly fds 0-2 and, when the harness asked for one, the
result channel as fd 3.
"""

import ctypes
import json
import os
import resource
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # -I left out the script's own dir
import fresh_root  # noqa: E402  (stdlib-only sibling; the scratch dir, our cwd, is never on sys.path)
import syscall_filter  # noqa: E402

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REC, MS_PRIVATE = 2, 4, 8, 16384, 1 << 18
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS, PR_SET_CHILD_SUBREAPER = 1, 38, 36
INIT_LEAD_S = 0.2   # init kills the program this long before the harness kills the group (room to sweep)

_libc = ctypes.CDLL(None, use_errno=True)


def _call(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(source, target, fstype, flags, data) -> None:
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    _call(_libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)),
          f"mount {target}")


def _unshare(cfg: dict, applied: list, notes: list) -> bool:
    """Try the full set, then without pid; returns whether a pid namespace was created."""
    if not cfg["namespaces"]:
        return False
    for flags, names in (
        (CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWNS | CLONE_NEWIPC | CLONE_NEWUTS, ["pidns", "netns", "mntns", "ipcns", "utsns"]),
        (CLONE_NEWNET | CLONE_NEWNS | CLONE_NEWIPC, ["netns", "mntns", "ipcns"]),
        (CLONE_NEWNET, ["netns"]),
    ):
        try:
            _call(_libc.unshare(ctypes.c_int(flags)), "unshare")
            applied.extend(names)
            return "pidns" in names
        except OSError as exc:
            notes.append(f"unshare {'+'.join(names)} failed: {exc.strerror}")
    return False


def _private_mounts(cfg: dict, applied: list, notes: list) -> None:
    """Private /proc (only our pid namespace visible) and fresh tmpfs over world-writable dirs."""
    if "mntns" not in applied:
        return
    try:
        _mount(None, "/", None, MS_REC | MS_PRIVATE, None)
    except OSError as exc:
        notes.append(str(exc))
        return
    for path in ("/tmp", "/var/tmp", "/dev/shm"):
        if os.path.isdir(path):
            try:
                _mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV,
                       f"size={cfg['tmpfs_bytes']},mode=1777")
                applied.append(f"tmpfs:{path}")
            except OSError as exc:
                notes.append(str(exc))
    if "pidns" in applied:
        try:
            _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None)
            applied.append("private-proc")
        except OSError as exc:
            notes.append(str(exc))


def _isolate_filesystem(cfg: dict, applied: list, mine: list, notes: list) -> dict:
    """Enter a fresh root when the namespaces allow; return the program's env."""
    env = dict(cfg["env"])
    if "mntns" not in applied or "tmpfs:/tmp" not in applied:
        notes.append("fresh root needs a mount namespace with a private /tmp")
    elif not cfg["root_paths"]:
        notes.append("fresh root disabled, or the interpreter's paths could not be probed")
    else:
        scratch = os.open(".", os.O_RDONLY | os.O_DIRECTORY)
        if fresh_root.enter(cfg["root_paths"], cfg["tmpfs_bytes"], "pidns" in applied, mine, notes):
            env["HOME"] = fresh_root.SCRATCH
        else:
            os.fchdir(scratch)
        os.close(scratch)
    return env


def _set_rlimits(cfg: dict) -> None:
    lim = cfg["limits"]
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    cpu = int(min(lim["cpu_s"], lim["wall_s"]) + 0.999)  # a backstop to the wall deadline as well
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    resource.setrlimit(resource.RLIMIT_AS, (lim["memory_bytes"], lim["memory_bytes"]))
    resource.setrlimit(resource.RLIMIT_FSIZE, (lim["max_file_bytes"], lim["max_file_bytes"]))
    resource.setrlimit(resource.RLIMIT_NOFILE, (lim["max_open_files"], lim["max_open_files"]))
    resource.setrlimit(resource.RLIMIT_NPROC, (cfg["nproc"], cfg["nproc"]))


def _deny_namespaces(cfg: dict, mine: list, notes: list) -> None:
    """Last step before exec: the seccomp filter, or the reason it is missing, in the report."""
    if not cfg["limits"]["deny_namespaces"]:
        notes.append("namespace filter disabled (SandboxLimits.deny_namespaces=False): the program may "
                     "create user namespaces, mount and chroot inside them")
        return
    reason = syscall_filter.install()
    if reason is None:
        mine.append("seccomp:no-namespaces")
    else:
        notes.append(f"namespace filter not applied ({reason}): the program may create user namespaces, "
                     "mount and chroot inside them")


def _exec_program(cfg: dict, applied: list, report_fd: int) -> None:
    """In the program child: filesystem, limits, drop privileges, filter, exec the interpreter. Never returns."""
    mine, notes = [], []
    try:
        env = _isolate_filesystem(cfg, applied, mine, notes)
        _set_rlimits(cfg)
        uid = cfg["uid"]
        if uid is not None:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
        _libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
        _deny_namespaces(cfg, mine, notes)
        _report(report_fd, mine, notes)
        report_fd = -1
        channel = cfg["channel_fd"]
        if channel is not None:
            if channel != 3:
                os.dup2(channel, 3)
            os.closerange(4, 1 << 16)
        else:
            os.closerange(3, 1 << 16)
        python = cfg["python"]
        os.execve(python, [python, "-s", "-c", cfg["bootstrap"], cfg["program"], cfg["guard"]], env)
    except BaseException as exc:  # report why the program could not start, distinctly from its own errors
        os.write(2, f"onecat-sandbox: could not start program: {exc!r}\n".encode())
        try:
            if report_fd >= 0:
                _report(report_fd, mine, notes)
        except BaseException:
            pass  # never return into init's code from this child
    os._exit(125)


def _report(fd: int, mechanisms: list, notes: list) -> None:
    """Tell init what this child applied (it reads until the pipe closes)."""
    os.write(fd, json.dumps({"mechanisms": mechanisms, "notes": notes}).encode())
    os.close(fd)


def _children(pid: int) -> list[int]:
    """Direct children of `pid`, from /proc (ppid is the field after the parenthesised name)."""
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as fh:
                    fields = fh.read().rsplit(b")", 1)[1].split()
                if int(fields[1]) == pid:
                    kids.append(int(entry))
            except (OSError, IndexError, ValueError):
                pass
    return kids


def _sweep_descendants() -> None:
    """Kill every remaining descendant. As a child subreaper, init inherits every orphan (even one
    that called setsid), so killing direct children until none is left gets all of them."""
    me = os.getpid()
    for _ in range(10_000):
        kids = _children(me)
        if not kids:
            break
        for kid in kids:
            try:
                os.kill(kid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for kid in kids:
            try:
                os.waitpid(kid, 0)
            except ChildProcessError:
                pass


def _merge_report(fd: int, applied: list, notes: list) -> None:
    """What the program's child applied before exec (it closes the pipe by then, or dies)."""
    chunks = []
    while True:
        data = os.read(fd, 65536)
        if not data:
            break
        chunks.append(data)
    os.close(fd)
    try:
        report = json.loads(b"".join(chunks) or b"{}")
        applied.extend(report.get("mechanisms", []))
        notes.extend(report.get("notes", []))
    except ValueError:
        notes.append("program child sent no isolation report")


def _run_init(cfg: dict, applied: list, notes: list, status_fd: int, launcher_pid: int) -> None:
    """Start the program, enforce the wall deadline, reap everything, report how the program ended.

    In a pid namespace this is pid 1 and its exit kills whatever is left; without one it is a child
    subreaper that kills the leftovers itself.
    """
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if "pidns" not in applied and os.getppid() != launcher_pid:
        os._exit(1)  # the launcher died before PDEATHSIG was armed
    if "pidns" not in applied and _libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0:
        applied.append("subreaper")
    _private_mounts(cfg, applied, notes)
    deadline = cfg["deadline"] - min(INIT_LEAD_S, cfg["limits"]["wall_s"] / 10)
    report_r, report_w = os.pipe()
    program_pid = os.fork()
    if program_pid == 0:
        os.close(status_fd)
        os.close(report_r)
        _exec_program(cfg, applied, report_w)
    os.close(report_w)
    if cfg["channel_fd"] is not None:
        os.close(cfg["channel_fd"])  # only the program holds the write end: EOF when it is gone
    _merge_report(report_r, applied, notes)
    status = {"mechanisms": applied, "notes": notes}
    os.write(status_fd, (json.dumps(status) + "\n").encode())  # known even if the harness kills us early
    pause = 0.001
    while True:
        try:
            pid, wstatus, usage = os.wait4(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == program_pid:
            if os.WIFSIGNALED(wstatus):
                status["signal"] = os.WTERMSIG(wstatus)
            else:
                status["exit_code"] = os.WEXITSTATUS(wstatus)
            status["cpu_s"] = usage.ru_utime + usage.ru_stime
            status["max_rss_kb"] = usage.ru_maxrss
            break
        if pid == 0:
            if time.monotonic() > deadline and not status.get("timed_out"):
                status["timed_out"] = True
                os.kill(program_pid, signal.SIGKILL)
            time.sleep(pause)
            pause = min(pause * 2, 0.02)
    if "pidns" not in applied:
        _sweep_descendants()
    os.write(status_fd, (json.dumps(status) + "\n").encode())
    os.close(status_fd)
    os._exit(0)  # in a pid namespace this kills whatever the program left behind


def main() -> None:
    cfg = json.loads(sys.argv[1])
    status_fd = cfg["status_fd"]
    applied: list = []
    notes: list = []
    uid = cfg["uid"]
    if uid is not None:
        os.chown(".", uid, uid)
        os.chmod(".", 0o700)  # other sandboxes (other uids) cannot read this one's files
        applied.append("uid-drop")
    _unshare(cfg, applied, notes)
    launcher_pid = os.getpid()
    init_pid = os.fork()
    if init_pid == 0:
        _run_init(cfg, applied, notes, status_fd, launcher_pid)
    os.close(status_fd)
    if cfg["channel_fd"] is not None:
        os.close(cfg["channel_fd"])
    os.waitpid(init_pid, 0)


if __name__ == "__main__":
    main()
