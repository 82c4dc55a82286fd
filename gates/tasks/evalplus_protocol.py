"""The EvalPlus driver's result channel as the harness reads it: strict messages, judged on arrival.

Threat model. The solution runs in the driver's process, so whatever the driver can do, it can do:
find the channel (fd 3, or via /proc/self/fd), write forged lines, close it, flood it, or read
any key the driver holds (so authenticating messages would prove nothing). Nothing on the channel
is therefore trusted as a verdict:
  * the driver reports only *outputs*; expected outputs never enter the sandbox. The harness holds
    the reference and compares each reported output with it, input by input. A forged row either
    carries the right output for its input (then the solution did produce it, which is what passing
    means) or a wrong one (the task fails); it can never turn a wrong output into a pass;
  * rows must arrive in order (load, then base 0..n-1, then plus 0..m-1), each exactly once;
  * every line is read under a size cap and checked against a strict schema (keys, types, sizes,
    the value encoding of pyvalues.decode_value, nesting depth). Anything else: bad JSON, wrong
    types, duplicate or out-of-order rows, deep nesting, an oversize line, a result before the
    load or a "done" before all results, fails *that task* with failure_reason
    "sandbox_protocol_error" and stops its sandbox; it never raises into the run;
  * the solution cannot read the reference either: the sandbox gives it a fresh root without the
    data directory or the harness's work folder (gates/sandbox/fresh_root.py), and the reference
    cache is 0700 as a second line where namespaces are unavailable.
The first failure (wrong answer, error, timeout, protocol error) ends the judging and the run.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Callable

from onecat.gates.tasks import pyvalues

PROTOCOL_ERROR = "sandbox_protocol_error"
SETS = ("base", "plus")
MAX_ERROR_CHARS = 2000
_ROW_KEYS = {"ok": ({"set", "i", "status", "out", "t"}, set()), "error": ({"set", "i", "status", "error"}, set()),
             "timeout": ({"set", "i", "status"}, {"t"})}


class ProtocolError(ValueError):
    """A channel line that is not a message the driver could have written."""


def _keys(msg: dict, required: set, optional: set = frozenset()) -> None:
    keys = set(msg)
    if not required <= keys or not keys <= required | optional:
        raise ProtocolError(f"unexpected keys {sorted(map(str, keys))[:8]}")


def _text(value: Any) -> str:
    if type(value) is not str or len(value) > MAX_ERROR_CHARS:
        raise ProtocolError("error text must be a string of at most 2000 chars")
    return value


def _seconds(value: Any) -> float:
    if type(value) not in (int, float) or not math.isfinite(value) or value < 0:
        raise ProtocolError("time must be a finite, non-negative number")
    return float(value)


def parse_message(line: bytes | None, max_bytes: int) -> dict:
    """One channel line as a schema-checked message; ProtocolError for anything else."""
    if line is None:
        raise ProtocolError(f"message longer than {max_bytes} bytes")
    try:
        msg = json.loads(line)
    except RecursionError:
        raise ProtocolError("message nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, int too long
        raise ProtocolError(f"not JSON: {str(exc)[:120]}") from None
    if type(msg) is not dict:
        raise ProtocolError(f"message is a {type(msg).__name__}, not an object")
    if "event" in msg:
        if msg["event"] == "done":
            _keys(msg, {"event"})
        elif msg["event"] == "load":
            status = msg.get("status")
            if status not in ("ok", "error", "timeout"):
                raise ProtocolError("load status must be ok, error or timeout")
            _keys(msg, {"event", "status"} | ({"error"} if status == "error" else set()))
            if status == "error":
                _text(msg["error"])
        else:
            raise ProtocolError("unknown event")
        return msg
    status = msg.get("status")
    if type(status) is not str or status not in _ROW_KEYS:
        raise ProtocolError("row status must be ok, error or timeout")
    _keys(msg, *_ROW_KEYS[status])
    if type(msg["set"]) is not str or msg["set"] not in SETS:
        raise ProtocolError("row set must be 'base' or 'plus'")
    if type(msg["i"]) is not int or msg["i"] < 0:
        raise ProtocolError("row index must be a non-negative int")
    if "t" in msg:
        _seconds(msg["t"])
    if status == "error":
        _text(msg["error"])
    return msg


@dataclass
class Failure:
    reason: str                  # wrong_answer | error | timeout | load_error | load_timeout | sandbox_protocol_error
    failed_set: str | None = None
    failed_index: int | None = None
    detail: str | None = None


class ChannelReader:
    """Shared order-keeping for both consumers: load first, then the rows of `sizes` in order."""

    def __init__(self, sizes: dict[str, int], max_line_bytes: int):
        self.plan = [(name, i) for name in SETS for i in range(sizes[name])]
        self.max_line_bytes = max_line_bytes
        self.position = 0
        self.loaded: str | None = None
        self.failure: Failure | None = None

    @property
    def complete(self) -> bool:
        return self.failure is None and self.loaded == "ok" and self.position == len(self.plan)

    def on_line(self, line: bytes | None) -> bool:
        """capture.Channel's consumer: True while more lines are wanted."""
        if self.failure is not None or self.complete:
            return False
        try:
            self._message(parse_message(line, self.max_line_bytes), line)
        except Exception as exc:  # ProtocolError, or anything a hostile value provoked while decoding
            detail = str(exc) if isinstance(exc, ProtocolError) else f"{type(exc).__name__}: {str(exc)[:200]}"
            self.failure = Failure(PROTOCOL_ERROR, detail=detail)
        return self.failure is None and not self.complete

    def _message(self, msg: dict, line: bytes) -> None:
        if "event" in msg:
            if msg["event"] == "done" or self.loaded is not None:
                raise ProtocolError(f"{msg['event']} event out of sequence")
            self.loaded = msg["status"]
            if msg["status"] != "ok":
                self.failure = Failure("load_timeout" if msg["status"] == "timeout" else "load_error",
                                       detail=msg.get("error"))
            return
        if self.loaded != "ok":
            raise ProtocolError("result before the solution loaded")
        if self.position >= len(self.plan) or (msg["set"], msg["i"]) != self.plan[self.position]:
            raise ProtocolError(f"result for {msg['set']}[{msg['i']}] out of order")
        name, index = self.plan[self.position]
        if msg["status"] != "ok":
            self.failure = Failure(msg["status"], name, index, msg.get("error"))
            return
        try:
            out = pyvalues.decode_value(msg["out"])
        except RecursionError:
            raise ProtocolError(f"{name}[{index}] output nested too deeply") from None
        except (ValueError, TypeError, OverflowError) as exc:
            raise ProtocolError(f"{name}[{index}] output is not an encoded value: {str(exc)[:120]}") from None
        self._row(name, index, out, msg["t"], len(line))
        self.position += 1

    def _row(self, name: str, index: int, out: Any, seconds: float, size: int) -> None:
        raise NotImplementedError


class CandidateJudge(ChannelReader):
    """Compare each reported output with the reference as it arrives; stop at the first failure.

    `matches(set_name, index, output)` is the task's comparison against the expected output."""

    def __init__(self, sizes: dict[str, int], max_line_bytes: int, matches: Callable[[str, int, Any], bool],
                 describe: Callable[[str, int, Any], str]):
        super().__init__(sizes, max_line_bytes)
        self._matches, self._describe = matches, describe

    def _row(self, name, index, out, seconds, size) -> None:
        if not self._matches(name, index, out):
            self.failure = Failure("wrong_answer", name, index, self._describe(name, index, out))


class ReferenceCollector(ChannelReader):
    """Keep the canonical solution's outputs and times, and its largest row (sets candidates' cap)."""

    def __init__(self, sizes: dict[str, int], max_line_bytes: int):
        super().__init__(sizes, max_line_bytes)
        self.outputs: dict[str, list] = {name: [] for name in SETS}
        self.times: dict[str, list[float]] = {name: [] for name in SETS}
        self.max_row_bytes = 0

    def _row(self, name, index, out, seconds, size) -> None:
        self.outputs[name].append(out)
        self.times[name].append(float(seconds))
        self.max_row_bytes = max(self.max_row_bytes, size)
