"""When a measured engine has failed, and how, so that a comparison never reports a dead engine as a slow one.

An engine has failed when its server process has died (at start or later: the exit code or the signal that
killed it, e.g. "killed by SIGSEGV (-11)", and its last output), or when every request of a unit of work
failed (the server is up and refuses them, or drops every connection). A failure is a dict:

    {"cause": "killed by SIGSEGV (-11)", "exit_code": -11, "output_tail": "...its last lines...", ...}
"""
from __future__ import annotations

import time
from typing import Any, Optional

from onecat.results.store import Store

DEATH_GRACE_S = 2.0  # after every request failed: how long a server that is going down gets to be seen dead


def died(engine: Any, wait_s: float = 0.0) -> Optional[dict]:
    """The engine's failure() (its server process exited on its own), waiting up to `wait_s` for it."""
    probe = getattr(engine, "failure", None)
    if probe is None:
        return None
    deadline = time.monotonic() + wait_s
    while True:
        failure = probe()
        if failure or time.monotonic() >= deadline:
            return failure
        time.sleep(0.1)


def output_tail(engine: Any) -> str:
    """The last lines of the engine's server log ("" for an engine without a server)."""
    proc = getattr(engine, "process", None)
    return proc.log_tail() if proc is not None else ""


def unit_failure(engine: Any, store: Store, run_id: str, arm: str, workload_id: str, unit_key: str) -> Optional[dict]:
    """Whether the engine failed during the unit just stored: its server died, or every request failed."""
    failure = died(engine)
    if failure:
        return failure
    rows = [r for r in store.requests(run_id, arm, workload_id) if r["unit_key"] == unit_key]
    failed = [r for r in rows if r["error"]]
    if not rows or len(failed) < len(rows):
        return None
    failure = died(engine, DEATH_GRACE_S)  # connections dropped because the server was going down
    if failure:
        return failure
    first = min(failed, key=lambda r: r["recorded_at"])["error"]
    return {"cause": f"every request of {workload_id} failed ({len(failed)} of {len(rows)}); the first: {first}",
            "exit_code": None, "output_tail": output_tail(engine)}


def exception_failure(engine: Any, exc: BaseException) -> dict:
    """An error while driving the engine: its server's death if that is what happened, else the error."""
    return died(engine, DEATH_GRACE_S) or {"cause": f"{type(exc).__name__}: {exc}", "exit_code": None,
                                           "output_tail": output_tail(engine)}


def failure_text(failure: dict) -> str:
    """The failure as one stored text: the cause, then the last output."""
    tail = (failure.get("output_tail") or "").rstrip()
    return failure["cause"] + (f"\nlast output:\n{tail}" if tail else "")
