"""A fresh root filesystem for the sandboxed program: only what the interpreter needs, read-only.

Imported by launcher.py inside the program's child process, before it drops privileges (stdlib
only, never imported by the harness). The child takes its own mount namespace, builds a small
tmpfs root and bind-mounts into it, read-only and at their host paths, just the interpreter, the
directories on its sys.path and the directories of the shared libraries it loads (the harness
probes these, see interpreter.py), plus /dev/null, /dev/zero, /dev/urandom, /dev/random,
/etc/ld.so.cache, a private /tmp, a pid-namespace /proc and the scratch directory at /sandbox.
Then it pivot_roots into it and detaches the old root, so nothing else of the host (the data
directory, the harness work folder and caches, the project tree, /root, home directories) exists
for the program at all. chroot is the fallback when pivot_root is refused.
"""

import ctypes
import os
import platform

CLONE_NEWNS = 0x00020000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_PRIVATE, MS_REC = 32, 4096, 1 << 18, 16384
MNT_DETACH = 2
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "ppc64le": 203, "s390x": 217}.get(platform.machine())

ROOT = "/tmp/.onecat-root"      # inside the namespace-private /tmp tmpfs the init process mounted
SCRATCH = "/sandbox"            # where the scratch directory appears; the program's cwd and HOME
DEVICES = ("/dev/null", "/dev/zero", "/dev/urandom", "/dev/random")
OPTIONAL_FILES = ("/etc/ld.so.cache",)

_libc = ctypes.CDLL(None, use_errno=True)


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(source, target, fstype=None, flags=0, data=None) -> None:
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    _check(_libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)),
           f"mount {target}")


def _bind_readonly(source: str, target: str, extra: int = MS_NOSUID | MS_NODEV) -> None:
    """Bind without submounts, then make that mount read-only (a bind ignores MS_RDONLY at first)."""
    _mount(source, target, None, MS_BIND, None)
    _mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | extra, None)


def _inside(path: str) -> str:
    return ROOT + path


def _make_mount_point(host_path: str) -> None:
    target = _inside(host_path)
    if os.path.isdir(host_path):
        os.makedirs(target, mode=0o755, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), mode=0o755, exist_ok=True)
        if not os.path.exists(target):
            os.close(os.open(target, os.O_CREAT | os.O_WRONLY, 0o644))


def _replicate(path: str, bound: set, depth: int = 0) -> None:
    """Make `path` resolve inside the new root as on the host: symlinks along the way are copied as
    symlinks (merged-/usr layouts: /lib64 -> usr/lib64 -> ...), the real file or dir is bound."""
    if depth > 40:
        raise OSError(f"too many symlinks resolving {path}")
    parts = [p for p in os.path.normpath(path).split("/") if p]
    current = ""
    for index, part in enumerate(parts):
        current = f"{current}/{part}"
        if os.path.islink(current):
            target = os.readlink(current)
            if not os.path.lexists(_inside(current)):
                os.makedirs(os.path.dirname(_inside(current)), mode=0o755, exist_ok=True)
                os.symlink(target, _inside(current))
            resolved = os.path.normpath(os.path.join(os.path.dirname(current), target))
            rest = "/".join(parts[index + 1:])
            _replicate(resolved + ("/" + rest if rest else ""), bound, depth + 1)
            return
    real = "/" + "/".join(parts)
    if any(real == b or real.startswith(b + "/") for b in bound):
        return  # already visible through a bound parent directory
    _make_mount_point(real)
    _bind_readonly(real, _inside(real))
    bound.add(real)


def _build(paths: list, tmpfs_bytes: int, with_proc: bool, applied: list, notes: list) -> None:
    os.makedirs(ROOT, mode=0o755, exist_ok=True)
    _mount("tmpfs", ROOT, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0755")
    bound: set = set()
    for path in sorted(set(paths), key=len):
        if os.path.exists(path):
            _replicate(path, bound)
    for path in DEVICES + OPTIONAL_FILES:
        if os.path.exists(path):
            _make_mount_point(path)
            _bind_readonly(path, _inside(path), MS_NOSUID | MS_NOEXEC)
    os.makedirs(_inside(SCRATCH), mode=0o755)
    _mount(".", _inside(SCRATCH), None, MS_BIND, None)  # cwd: the scratch dir, even if /tmp hides it
    _mount(None, _inside(SCRATCH), None, MS_REMOUNT | MS_BIND | MS_NOSUID | MS_NODEV, None)
    os.makedirs(_inside("/tmp"), mode=0o755)
    _mount("tmpfs", _inside("/tmp"), "tmpfs", MS_NOSUID | MS_NODEV, f"size={tmpfs_bytes},mode=1777")
    if with_proc:
        os.makedirs(_inside("/proc"), mode=0o755)
        try:  # hidepid: the program does not even see init (uid 0) in its pid namespace
            _mount("proc", _inside("/proc"), "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, "hidepid=2")
            applied.append("root-proc:hidepid")
        except OSError:
            _mount("proc", _inside("/proc"), "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None)
            applied.append("root-proc")
    else:
        notes.append("fresh root has no /proc: without a pid namespace it would show the host's processes")
    _mount(None, ROOT, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV, None)


def _pivot() -> str:
    """Switch this process's root to ROOT and detach the old one; chroot where pivot_root is refused."""
    os.chdir(ROOT)
    if SYS_PIVOT_ROOT is not None:
        try:
            _check(_libc.syscall(ctypes.c_long(SYS_PIVOT_ROOT), b".", b"."), "pivot_root")
            _check(_libc.umount2(b".", MNT_DETACH), "umount old root")
            os.chdir("/")
            return "pivot_root"
        except OSError:
            pass
    os.chroot(ROOT)
    os.chdir("/")
    return "chroot"


def enter(paths: list, tmpfs_bytes: int, with_proc: bool, applied: list, notes: list) -> bool:
    """Give this process (the program's child, still root) its own mount namespace and a fresh root.

    Returns False, with the reason in `notes`, when the OS refuses; the caller keeps the host view.
    """
    try:
        _check(_libc.unshare(ctypes.c_int(CLONE_NEWNS)), "unshare mount namespace")
        _mount(None, "/", None, MS_REC | MS_PRIVATE, None)
        _build(paths, tmpfs_bytes, with_proc, applied, notes)
        applied.append("fresh-root:" + _pivot())
        os.chdir(SCRATCH)
        return True
    except OSError as exc:
        notes.append(f"fresh root not applied: {exc}")
        return False
