"""A server process the harness starts and stops itself: command line, log file, readiness, shutdown.

Used by the managed backends (`onecat serve`, `vllm serve`, llama.cpp's server) and by the load
benchmark. The log (stdout + stderr) is kept in `log_dir` next to the run's other outputs.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def exit_cause(returncode: int) -> str:
    """How a process ended, in words that keep the number: "exited with code 3", "killed by SIGSEGV (-11)"
    (a shell's 128+N for signal N is named too)."""
    def name(signum: int) -> str | None:
        try:
            return signal.Signals(signum).name
        except ValueError:
            return None

    if returncode < 0:
        return f"killed by {name(-returncode) or f'signal {-returncode}'} ({returncode})"
    if returncode > 128 and name(returncode - 128):
        return f"exited with code {returncode} (128 + {name(returncode - 128)}: a shell's report of that signal)"
    return f"exited with code {returncode}"


class ServerStartError(RuntimeError):
    """The server exited or never became ready; the message carries the tail of its log. `returncode` is the
    exit status (None when it timed out), `output_tail` its last output."""

    def __init__(self, message: str, returncode: int | None = None, output_tail: str = ""):
        super().__init__(message)
        self.returncode, self.output_tail = returncode, output_tail


class ServerProcess:
    def __init__(self, argv: list[str], *, port: int, host: str = "127.0.0.1", log_dir: str | Path,
                 name: str = "server", env: dict[str, str] | None = None, ready_path: str = "/health",
                 startup_timeout_s: float = 300.0):
        self.argv, self.port, self.host = list(argv), port, host
        self.url = f"http://{host}:{port}"
        self.log_path = Path(log_dir) / f"{name}.log"
        self.env = {**os.environ, **(env or {})}
        self.ready_path = ready_path
        self.startup_timeout_s = startup_timeout_s
        self.proc: subprocess.Popen | None = None
        self.startup_s: float | None = None

    def start(self) -> "ServerProcess":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        log.write(("$ " + " ".join(self.argv) + "\n").encode())
        log.flush()
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                     start_new_session=True)
        log.close()
        deadline = time.monotonic() + self.startup_timeout_s
        delay = 0.05  # a stub is up in a tenth of a second, vLLM in a minute: poll often first, then less
        while True:
            if self.proc.poll() is not None:
                tail = self.log_tail()
                raise ServerStartError(f"{self.argv[0]} {exit_cause(self.proc.returncode)} before it was ready; log "
                                       f"{self.log_path}:\n{tail}", self.proc.returncode, tail)
            try:
                if httpx.get(self.url + self.ready_path, timeout=2.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                tail = self.log_tail()
                raise ServerStartError(f"{self.argv[0]} not ready after {self.startup_timeout_s:.0f} s; log "
                                       f"{self.log_path}:\n{tail}", None, tail)
            time.sleep(delay)
            delay = min(2 * delay, 0.5)
        self.startup_s = time.perf_counter() - t0
        return self

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def exit_failure(self) -> dict | None:
        """None while it runs (or before it started); once it has exited on its own: how (`cause`,
        `exit_code`) and its last output (`output_tail`). Read it before stop(), which ends it on purpose."""
        if self.proc is None or self.proc.poll() is None:
            return None
        return {"cause": exit_cause(self.proc.returncode), "exit_code": self.proc.returncode,
                "output_tail": self.log_tail()}

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self, timeout_s: float = 20.0) -> int | None:
        """SIGINT (graceful), then SIGKILL to the process group after `timeout_s`."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGINT)
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
            except ProcessLookupError:
                pass
        return self.proc.returncode


def onecat_serve_argv(model: str, *, port: int, host: str = "127.0.0.1", served_model_name: str | None = None,
                      flags: dict | None = None, python: str | None = None) -> list[str]:
    """`python -m onecat.cli.main serve MODEL ...` with vLLM-style flags from a dict (None values skipped,
    booleans as --flag / --no-flag); `python`: the interpreter (default: this one)."""
    argv = [python or sys.executable, "-m", "onecat.cli.main", "serve", model, "--host", host, "--port", str(port)]
    if served_model_name:
        argv += ["--served-model-name", served_model_name]
    for key, value in (flags or {}).items():
        flag = "--" + key.replace("_", "-")
        if value is None:
            continue
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + key.replace("_", "-"))
        else:
            argv += [flag, str(value)]
    return argv
