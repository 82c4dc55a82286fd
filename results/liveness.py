"""Is the process that was writing a run still alive?

A run row records its writer as pid + host + the process's start time. The start time defeats pid
reuse: after a crash another process may get the same pid, but not the same start time. On Linux the
start time is the boot id plus the start tick from /proc/PID/stat; elsewhere it is unknown and the
check falls back to "does a process with this pid exist". A writer on another host cannot be checked
from here: its state is unknown (None), never guessed.
"""
from __future__ import annotations

import os
import socket
from typing import Any, Optional

_STAT_STATE, _STAT_STARTTIME = 0, 19  # fields 3 and 22 of /proc/PID/stat, counted after "(comm)"


def _proc_stat(pid: int) -> Optional[list[str]]:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as fh:
            text = fh.read()
    except OSError:
        return None
    return text.rsplit(")", 1)[-1].split()  # the command name may itself hold spaces or ")"


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as fh:
            return fh.read().strip()
    except OSError:
        return ""


def process_start(pid: int) -> Optional[str]:
    """An id of when process `pid` started ("BOOT_ID/TICKS"), or None where the system does not say."""
    fields = _proc_stat(pid)
    if not fields or len(fields) <= _STAT_STARTTIME:
        return None
    return f"{_boot_id()}/{fields[_STAT_STARTTIME]}"


def this_writer() -> dict[str, Any]:
    """The columns that name the current process as a run's writer."""
    pid = os.getpid()
    return {"writer_pid": pid, "writer_host": socket.gethostname(), "writer_started": process_start(pid)}


def _pid_exists(pid: int) -> Optional[bool]:
    if os.name == "nt":  # os.kill would terminate it there
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: it exists
        return True
    except OSError:
        return None
    return True


def writer_alive(pid: Optional[int], host: Optional[str], started: Optional[str]) -> Optional[bool]:
    """True or False when this machine can tell whether the recorded writer still runs; None when not
    (nothing recorded, another host, an unknown platform)."""
    if pid is None or host is None or host != socket.gethostname():
        return None
    fields = _proc_stat(int(pid))
    if fields is not None:
        if fields[_STAT_STATE] in ("Z", "X"):  # exited, waiting to be reaped
            return False
        return started is None or process_start(int(pid)) == started
    if os.path.isdir("/proc/self"):  # /proc works here, and has no entry for this pid
        return False
    return _pid_exists(int(pid))


def interrupted_reason(run: dict) -> str:
    """Why a `running` run whose writer is gone is `interrupted`, and how to continue it."""
    if run.get("writer_pid") is None:
        who = "its writer was not recorded (the run predates writer tracking) and no process holds the store"
    else:
        who = f"its writer (pid {run['writer_pid']} on {run.get('writer_host')}) is gone"
    resume = f"onecat gate run --resume {run.get('contract_path') or 'CONTRACT'}"
    return f"{who}: killed or crashed before finishing; `{resume}` continues it"
