"""Reading what a sandboxed program writes, with memory bounded whatever it writes.

stdout/stderr: the first `cap` bytes are kept, the rest is read and dropped as it arrives (never
buffered), so a program printing gigabytes costs the harness a pipe's worth of memory.
The result channel (the program's fd 3): split into lines of at most `max_line_bytes`; a longer
line is skipped while it streams in and reported as one oversize line; each line goes to the
consumer as soon as it is complete, so no more than one line is ever held.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Callable

READ_SIZE = 1 << 16


@dataclass
class Channel:
    """Where the program's fd 3 goes: `on_line(line)` per complete line, `on_line(None)` for a line
    longer than `max_line_bytes` (dropped unread). Returning False stops the program at once (the
    consumer has seen enough, e.g. a wrong answer or a malformed message); later lines are dropped."""

    on_line: Callable[[bytes | None], bool]
    max_line_bytes: int = 1 << 20


class CappedPipe(threading.Thread):
    """Drain one output pipe to EOF keeping at most `cap` bytes."""

    def __init__(self, stream, cap: int):
        super().__init__(daemon=True)
        self._stream, self._cap = stream, cap
        self._chunks: list[bytes] = []
        self._kept = 0
        self.truncated = False

    def run(self) -> None:
        read = getattr(self._stream, "read1", self._stream.read)
        while True:
            data = read(READ_SIZE)
            if not data:
                break
            room = self._cap - self._kept
            if room > 0:
                self._chunks.append(data[:room])
                self._kept += min(room, len(data))
            if len(data) > room:
                self.truncated = True

    def collected(self) -> bytes:
        return b"".join(list(self._chunks))


class LineReader(threading.Thread):
    """Read the result channel's pipe to EOF and hand each line to `channel.on_line`.

    `stop` is set when the consumer asks to stop or raises; a consumer error is kept in `error`
    (the harness reports it as the run's protocol failure instead of crashing). An unterminated
    last line (a writer killed mid-line) is dropped: it cannot be a complete message.
    """

    def __init__(self, fd: int, channel: Channel, stop: threading.Event):
        super().__init__(daemon=True)
        self._fd, self._channel, self._halt = fd, channel, stop
        self.error: BaseException | None = None

    def _deliver(self, line: bytes | None) -> None:
        try:
            keep_going = self._channel.on_line(line)
        except BaseException as exc:  # the consumer's bug must not kill the reader or the run
            self.error, keep_going = exc, False
        if not keep_going:
            self._halt.set()

    def run(self) -> None:
        cap = self._channel.max_line_bytes
        buf = bytearray()
        oversize = False
        while True:
            try:
                data = os.read(self._fd, READ_SIZE)
            except OSError:
                break
            if not data:
                break
            if self._halt.is_set():
                continue  # keep draining so the writer never blocks, but look at nothing
            start = 0
            while start <= len(data) and not self._halt.is_set():
                newline = data.find(b"\n", start)
                end = len(data) if newline < 0 else newline
                if not oversize:
                    if len(buf) + end - start > cap:
                        oversize = True
                        buf.clear()
                    else:
                        buf += data[start:end]
                if newline < 0:
                    break
                self._deliver(None if oversize else bytes(buf))
                buf.clear()
                oversize = False
                start = newline + 1
