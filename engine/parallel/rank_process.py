"""A tensor-parallel worker rank's operating-system process, as rank 0 starts and watches it.

multiprocessing's spawn re-imports the user's main module in every child before it runs anything: a
script read on standard input has no file to re-import (every child dies at once), and a script without
an `if __name__ == "__main__"` guard builds a whole engine again in every child. A worker needs nothing
from the user's module, so rank 0 starts `python -m onecat.engine.parallel.rank_main FD RANK` itself: the
child gets one end of a socket pair as descriptor FD, wraps it in a multiprocessing `Connection` (what a
spawn pipe is) and serves its rank (rank_main.py, runtime.serve_rank). Scripts on stdin, notebooks and
unguarded scripts all work, and nothing of the user's code runs twice.

The child's stderr passes through rank 0, which forwards each line (marked with the rank) and keeps the
last few, so a worker that dies without a word over the connection (a crash, a signal, a failure
before onecat is imported) is still described by its exit and its last lines.
"""
from __future__ import annotations

import collections
import signal
import socket
import subprocess
import sys
import threading
from multiprocessing.connection import Connection

ENTRY_MODULE = "onecat.engine.parallel.rank_main"  # what the child runs
STDERR_LINES_KEPT = 20


def describe_exit(code: int | None) -> str:
    """How a process ended, in words (a negative code is the signal that killed it, as Popen reports)."""
    if code is None:
        return "running"
    if code < 0:
        try:
            return f"killed by signal {-code} ({signal.Signals(-code).name})"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


class RankProcess:
    """Rank 0's handle on one worker process: the part of multiprocessing.Process the engine uses
    (pid, is_alive, join, terminate, kill, exitcode), its connection, and its last stderr lines."""

    def __init__(self, rank: int):
        self.rank = rank
        ours, theirs = socket.socketpair()
        try:
            self._popen = subprocess.Popen([sys.executable, "-m", ENTRY_MODULE, str(theirs.fileno()), str(rank)],
                                           pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL,
                                           stderr=subprocess.PIPE)
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self.pid = self._popen.pid
        self.conn = Connection(ours.detach())
        self._last_lines: collections.deque[str] = collections.deque(maxlen=STDERR_LINES_KEPT)
        self._stderr_reader = threading.Thread(target=self._forward_stderr, name=f"onecat-tp-rank{rank}-stderr",
                                               daemon=True)
        self._stderr_reader.start()

    def _forward_stderr(self) -> None:
        prefix = f"(tp rank {self.rank}) "
        for raw in iter(self._popen.stderr.readline, b""):
            line = raw.decode(errors="replace").rstrip("\n")
            self._last_lines.append(line)
            try:
                sys.stderr.write(prefix + line + "\n")
                sys.stderr.flush()
            except (ValueError, OSError, AttributeError):  # stderr closed or gone (interpreter exit)
                pass
        self._popen.stderr.close()

    @property
    def exitcode(self) -> int | None:
        return self._popen.poll()

    def is_alive(self) -> bool:
        return self._popen.poll() is None

    def join(self, timeout: float | None = None) -> None:
        try:
            self._popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def terminate(self) -> None:
        if self.is_alive():
            self._popen.terminate()

    def kill(self) -> None:
        if self.is_alive():
            self._popen.kill()

    def how_it_ended(self) -> str:
        """The exit (waiting a moment for a dying process) and the last stderr lines, for an error message."""
        self.join(timeout=2)
        if not self.is_alive():
            self._stderr_reader.join(timeout=1)  # the last lines are in once the pipe closed
        said = "\n".join(f"    {line}" for line in self._last_lines)
        return describe_exit(self.exitcode) + (f"; its last stderr lines:\n{said}" if said else "")
