"""A seccomp filter that keeps the sandboxed program out of namespaces, mounts and root changes.

The program runs as an unprivileged uid, but Linux lets any uid create a user namespace, and inside
one it holds every capability: it can then mount filesystems and chroot, and reaches kernel code
that only privileged users normally reach. The sandbox needs none of that after its own setup, so
the program's child installs this filter (with no_new_privs already set) just before exec:

  * unshare, setns, mount, umount2, pivot_root, chroot and the new mount API (open_tree,
    move_mount, fsopen, fsconfig, fsmount, fspick, mount_setattr) fail with EPERM;
  * clone fails with EPERM when its flags ask for any new namespace (CLONE_NEWNS, NEWCGROUP, NEWUTS,
    NEWIPC, NEWUSER, NEWPID, NEWNET); an ordinary fork or thread passes;
  * clone3 fails with ENOSYS: its flags sit in memory a filter cannot read, and libc then falls
    back to clone, whose flags the filter checks;
  * a syscall from another ABI (i386 through int 0x80, x32) kills the process: the numbers above
    are only valid for x86_64.

The filter is inherited by every child and survives exec; it cannot be removed. Only x86_64 has a
syscall table here: elsewhere `install` declines and says why, and the run's notes say so.
Imported by launcher.py by file name (stdlib only, never by the harness).
"""

import ctypes
import errno
import platform

PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 38, 22, 2
AUDIT_ARCH_X86_64 = 0xC000003E
X32_SYSCALL_BIT = 0x40000000
SECCOMP_RET_KILL_PROCESS, SECCOMP_RET_ERRNO, SECCOMP_RET_ALLOW = 0x80000000, 0x00050000, 0x7FFF0000
NAMESPACE_CLONE_FLAGS = (0x00020000 | 0x02000000 | 0x04000000 | 0x08000000   # NEWNS NEWCGROUP NEWUTS NEWIPC
                         | 0x10000000 | 0x20000000 | 0x40000000)              # NEWUSER NEWPID NEWNET

# x86_64 numbers (arch/x86/entry/syscalls/syscall_64.tbl)
X86_64_DENIED = {"unshare": 272, "setns": 308, "mount": 165, "umount2": 166, "pivot_root": 155,
                 "chroot": 161, "open_tree": 428, "move_mount": 429, "fsopen": 430, "fsconfig": 431,
                 "fsmount": 432, "fspick": 433, "mount_setattr": 442}
X86_64_CLONE, X86_64_CLONE3 = 56, 435

# classic BPF opcodes
_LD_W_ABS, _JEQ_K, _JGE_K, _JSET_K, _RET_K = 0x20, 0x15, 0x35, 0x45, 0x06
_OFFSET_NR, _OFFSET_ARCH, _OFFSET_ARG0_LOW = 0, 4, 16   # struct seccomp_data, little-endian


class _SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_SockFilter))]


def x86_64_program() -> list[tuple[int, int, int, int]]:
    """The filter as (code, jt, jf, k) instructions; jumps are relative to the next instruction."""
    deny = sorted(X86_64_DENIED.values())
    # tail, in order: [clone check: ld arg0, jset -> EPERM] ALLOW, EPERM, ENOSYS, KILL
    prog: list[tuple[int, int, int, int]] = []
    body_len = 2 + 2 + 1 + len(deny) + 2      # arch load+check, nr load + x32 check, clone3, denies, clone
    tail = {"clone_flags": body_len, "allow": body_len + 2, "eperm": body_len + 3,
            "enosys": body_len + 4, "kill": body_len + 5}

    def jump(index: int, label: str) -> int:
        return tail[label] - (index + 1)

    prog.append((_LD_W_ABS, 0, 0, _OFFSET_ARCH))
    prog.append((_JEQ_K, 0, jump(1, "kill"), AUDIT_ARCH_X86_64))
    prog.append((_LD_W_ABS, 0, 0, _OFFSET_NR))
    prog.append((_JGE_K, jump(3, "kill"), 0, X32_SYSCALL_BIT))
    prog.append((_JEQ_K, jump(4, "enosys"), 0, X86_64_CLONE3))
    for nr in deny:
        prog.append((_JEQ_K, jump(len(prog), "eperm"), 0, nr))
    prog.append((_JEQ_K, jump(len(prog), "clone_flags"), 0, X86_64_CLONE))
    prog.append((_RET_K, 0, 0, SECCOMP_RET_ALLOW))          # nothing matched
    assert len(prog) == body_len
    prog.append((_LD_W_ABS, 0, 0, _OFFSET_ARG0_LOW))        # clone's flags (the kernel reads 32 bits)
    prog.append((_JSET_K, jump(len(prog), "eperm"), 0, NAMESPACE_CLONE_FLAGS))
    prog.append((_RET_K, 0, 0, SECCOMP_RET_ALLOW))
    prog.append((_RET_K, 0, 0, SECCOMP_RET_ERRNO | errno.EPERM))
    prog.append((_RET_K, 0, 0, SECCOMP_RET_ERRNO | errno.ENOSYS))
    prog.append((_RET_K, 0, 0, SECCOMP_RET_KILL_PROCESS))
    return prog


def unsupported_reason(machine: str | None = None) -> str | None:
    """Why the filter cannot be installed on this machine, or None when it can."""
    machine = machine or platform.machine()
    if machine != "x86_64":
        return f"no syscall table for {machine} (only x86_64)"
    return None


def install() -> str | None:
    """Install the filter on the calling process. Returns None when installed, else why not."""
    reason = unsupported_reason()
    if reason is not None:
        return reason
    libc = ctypes.CDLL(None, use_errno=True)
    instructions = x86_64_program()
    array = (_SockFilter * len(instructions))(*[_SockFilter(*ins) for ins in instructions])
    fprog = _SockFprog(len(instructions), ctypes.cast(array, ctypes.POINTER(_SockFilter)))
    long = ctypes.c_ulong
    if libc.prctl(PR_SET_NO_NEW_PRIVS, long(1), long(0), long(0), long(0)) != 0:
        return f"prctl(PR_SET_NO_NEW_PRIVS) failed: errno {ctypes.get_errno()}"
    if libc.prctl(PR_SET_SECCOMP, long(SECCOMP_MODE_FILTER), ctypes.byref(fprog), long(0), long(0)) != 0:
        err = ctypes.get_errno()
        return f"prctl(PR_SET_SECCOMP) failed: {errno.errorcode.get(err, err)}"
    return None
