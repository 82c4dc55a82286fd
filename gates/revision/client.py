"""The harness side of a revision worker (worker.py): start it, call it, rebuild its outputs, stop it.

Outputs come back as plain data and are rebuilt with the harness's own RequestOutput / ScoreOutput, so
the runners and checks read them exactly as they read the in-process engine's. A worker that fails to
import its engine, answers with an error, or dies is a RevisionError naming the arm, the code and the
worker's last output lines.
"""
from __future__ import annotations

import dataclasses
import socket
import subprocess
import sys
import tempfile
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from onecat.gates.contract import CodeRevision
from onecat.gates.revision.errors import RevisionError
from onecat.gates.revision.repository import main_checkout
from onecat.gates.revision.worktrees import import_root

WORKER_SCRIPT = Path(__file__).with_name("worker.py")
LOG_TAIL_CHARS = 2000


class EngineWorker:
    """One worker process serving the engine of `code` for arm `arm`."""

    def __init__(self, arm: str, code: CodeRevision):
        self.arm, self.code = arm, code
        name = code.commit if code.ref is not None else "working-tree"
        root = import_root(main_checkout(Path(code.source)), Path(code.source), name)
        ours, theirs = socket.socketpair()
        self.log = tempfile.TemporaryFile(prefix=f"onecat-worker-{arm}-")
        try:
            self.proc = subprocess.Popen(
                [sys.executable, str(WORKER_SCRIPT), "--import-root", str(root),
                 "--engine-dir", str(Path(code.source) / "engine"), "--fd", str(theirs.fileno())],
                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, stdout=self.log, stderr=self.log)
        finally:
            theirs.close()
        self.conn = Connection(ours.detach())
        self.service_s = 0.0  # time the engine spent on requests, as the worker measured it
        self._receive("start")

    def call(self, op: str, *args: Any) -> Any:
        try:
            self.conn.send((op, args))
        except OSError:
            raise self._died(op) from None
        return self._receive(op)

    def _receive(self, op: str) -> Any:
        try:
            status, result, *seconds = self.conn.recv()
        except (EOFError, OSError):
            raise self._died(op) from None
        self.service_s += sum(seconds)
        if status == "error":
            where = "importing its engine" if op == "start" else op
            raise RevisionError(f"arm {self.arm} ({self.code.label}): {where} failed in the worker: "
                                f"{result['type']}: {result['message']}")
        return result

    def _died(self, op: str) -> RevisionError:
        try:
            code = self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            code = None
        return RevisionError(f"arm {self.arm} ({self.code.label}): the engine worker died during {op} "
                             f"(exit code {code}); its last output:\n{self.output_tail()}")

    def output_tail(self) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")[-LOG_TAIL_CHARS:].strip() or "(none)"

    def close(self) -> None:
        """Ask the worker to release the engine and exit; kill it if it does not."""
        try:
            if self.proc.poll() is None:
                self.call("close")
        except RevisionError:
            pass
        finally:
            self.conn.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.log.close()


class WorkerTokenizer:
    """The worker engine's tokenizer: its plain attributes as the worker reported them, its methods by call."""

    def __init__(self, worker: EngineWorker, attributes: dict[str, Any]):
        self._worker = worker
        self.__dict__.update(attributes)

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return self._worker.call("tokenizer", method, args, kwargs)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._call("encode", text, add_special_tokens=add_special_tokens)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._call("decode", list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._call("token_to_id", token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._call("id_to_token", token_id)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        return self._call("apply_chat_template", messages, add_generation_prompt=add_generation_prompt, **kwargs)


# --------------------------------------------------------------------------- data across the pipe
def _changed_fields(obj: Any) -> dict[str, Any]:
    out = {}
    for f in dataclasses.fields(obj):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        value = getattr(obj, f.name)
        if value != default:
            out[f.name] = value
    return out


def params_payload(params: Any) -> Any:
    """SamplingParams (one, or one per prompt) as the fields that differ from the defaults."""
    if isinstance(params, (list, tuple)):
        return [params_payload(p) for p in params]
    if params is None:
        return {}
    fields = _changed_fields(params)
    if fields.pop("logits_processors", None):
        raise RevisionError("logits_processors are functions of the harness process and cannot run in an engine "
                            "worker; this workload cannot run on an arm that pins code")
    return fields


def _known(cls: type, data: dict) -> dict:
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in data.items() if k in names}


def request_output(data: dict) -> Any:
    """The harness's RequestOutput from the worker's dict (fields this revision does not know are dropped)."""
    from onecat.engine.outputs import RequestOutput, RequestTimings, SpecDecodeCounts

    known = _known(RequestOutput, data)
    known["timings"] = RequestTimings(**_known(RequestTimings, data.get("timings") or {}))
    known["spec"] = SpecDecodeCounts(**_known(SpecDecodeCounts, data.get("spec") or {}))
    return RequestOutput(**known)


def score_output(data: dict) -> Any:
    from onecat.engine.outputs import ScoreOutput

    return ScoreOutput(**_known(ScoreOutput, data))
