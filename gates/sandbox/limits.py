"""Resource limits for one sandboxed program; frozen so a run's limits can be recorded as-is."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class SandboxLimits:
    """Per-program limits. Defaults suit one test program; EvalPlus raises memory like upstream (4 GiB).

    wall_s is a hard limit: counted from the launch, the harness SIGKILLs the sandbox's whole process
    group at wall_s, whatever the program does with signals (the sandbox's init kills the program a
    moment before, to sweep what it forked). RLIMIT_CPU at min(cpu_s, wall_s) is the backstop.
    """

    cpu_s: float = 10.0                  # RLIMIT_CPU at min(cpu_s, wall_s) (soft; hard = soft + 1 s: SIGKILL)
    wall_s: float = 20.0                 # hard wall-clock limit: SIGKILL of the whole process group
    memory_bytes: int = 1 << 30          # RLIMIT_AS
    max_processes: int = 16              # RLIMIT_NPROC for the sandbox's own uid
    max_file_bytes: int = 16 << 20       # RLIMIT_FSIZE
    max_open_files: int = 256            # RLIMIT_NOFILE
    max_output_bytes: int = 64 << 10     # stdout/stderr kept per stream; the rest is read and dropped
    tmpfs_bytes: int = 64 << 20          # size of the private /tmp, /var/tmp, /dev/shm
    python_guard: bool = True            # second layer: socket layer + destructive builtins disabled
    namespaces: bool = True              # first layer: pid/net/mount/ipc/uts namespaces when the OS allows
    fresh_root: bool = True              # with a mount namespace: only the interpreter's files are visible
    deny_namespaces: bool = True         # seccomp: no unshare/setns/mount/chroot/namespace clone (x86_64)

    def __post_init__(self) -> None:
        for name in ("cpu_s", "wall_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"SandboxLimits.{name} must be > 0, got {getattr(self, name)!r}")
        for name in ("memory_bytes", "max_processes", "max_file_bytes", "max_open_files",
                     "max_output_bytes", "tmpfs_bytes"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"SandboxLimits.{name} must be a positive integer")

    def to_dict(self) -> dict:
        return asdict(self)
