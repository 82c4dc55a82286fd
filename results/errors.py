"""What can be wrong with a results store, said so that the user knows what to do next.

Every message names the file and says what to do. A damaged store is never modified: the store checks
a file before DuckDB may write to it, and nothing here deletes or "repairs" anything.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Optional

import duckdb

NOTHING_CHANGED = "Nothing was changed"
RESTORE_ADVICE = (f"{NOTHING_CHANGED}; restore it from a backup, or move it aside and pass another --db "
                  "(a new store is created there)")


class StoreError(RuntimeError):
    """The results store cannot be used as asked; the message says why and what to do."""

    def __init__(self, path: str | Path, message: str):
        super().__init__(message)
        self.path = str(path)


class StoreBusy(StoreError):
    """Another process holds DuckDB's lock on the store: a `gate run` writing it or, for a writer, a reader."""

    def __init__(self, path: str | Path, pid: Optional[int] = None, why_no_snapshot: str = "",
                 for_writing: bool = False):
        pid_text = f" (pid {pid})" if pid else ""
        if for_writing:
            message = (f"the store {path} is in use: another process{pid_text} has it open, a run writing it or "
                       "a reader; try again when it finishes")
        else:
            extra = f" (a snapshot could not be read either: {why_no_snapshot})" if why_no_snapshot else ""
            message = f"the store {path} is busy: a run{pid_text} is writing it; try again when it finishes{extra}"
        super().__init__(path, message)
        self.pid = pid


class StoreCorrupt(StoreError):
    """The file is not a readable onecat results store: damaged, truncated, or something else entirely."""

    def __init__(self, path: str | Path, problem: str, advice: str = RESTORE_ADVICE):
        super().__init__(path, f"the results store {path} {problem}. {advice}.")
        self.problem = problem


class StoreTooNew(StoreError):
    """The file was written by another DuckDB version, or by a newer onecat (a newer schema)."""


class StoreOlder(StoreError):
    """Opened read-only, a store with an older schema cannot be migrated in place (reading.py reads a
    migrated copy instead)."""


def lock_holder_pid(message: str) -> Optional[int]:
    """The pid DuckDB names in its lock-conflict message, if any."""
    m = re.search(r"\(PID (\d+)\)", message)
    return int(m.group(1)) if m else None


def as_store_error(path: str | Path, exc: BaseException) -> Optional[StoreError]:
    """The StoreError a DuckDB exception means for the file at `path`, or None when it is not about the file
    (a user's SQL error, a bug)."""
    if isinstance(exc, StoreError):
        return exc
    if not isinstance(exc, duckdb.Error) or isinstance(exc, (duckdb.ProgrammingError, duckdb.DataError)):
        return None  # bad SQL or data, not a bad file
    msg = str(exc)
    first = msg.strip().splitlines()[0] if msg.strip() else type(exc).__name__
    if "Could not set lock" in msg or "Conflicting lock" in msg:
        return StoreBusy(path, lock_holder_pid(msg))
    if "not a valid DuckDB database file" in msg:
        return StoreCorrupt(path, "is not a DuckDB database")
    if "Could not read enough bytes" in msg:
        return StoreCorrupt(path, f"is truncated: part of it is missing ({first})")
    if isinstance(exc, duckdb.IOException) and re.search(r"version number|(newer|older) version", msg):
        return StoreTooNew(path, f"the results store {path} was written by another DuckDB version than the "
                                 f"installed {duckdb.__version__}: {first}. {NOTHING_CHANGED}; install the "
                                 "duckdb version that wrote it, or pass another --db")
    if "Corrupt database file" in msg or isinstance(exc, (duckdb.SerializationException, duckdb.InternalException,
                                                          duckdb.FatalException)):
        return StoreCorrupt(path, f"is damaged: {first}")
    return None
