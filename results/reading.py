"""Open a results store to read it, whatever state it is in: idle, written by a run, or damaged.

    with open_for_reading(path) as store: ...
        store.snapshot_of   # set when a run holds the store, or its schema is older than this onecat's:
                            # this is a copy (snapshot.py), migrated in the second case
        store.warnings      # runs or units the database lost (journal.py)

Raises StoreCorrupt for a damaged file (left untouched), StoreBusy when a run writes the store and not
even a snapshot could be read, StoreTooNew for a store from a newer onecat or DuckDB.
"""
from __future__ import annotations

import time
from pathlib import Path

import duckdb

from onecat.results import snapshot
from onecat.results.errors import StoreBusy, StoreError, StoreOlder
from onecat.results.store import Store

SNAPSHOT_ATTEMPTS = 3


def open_for_reading(path: str | Path) -> Store:
    try:
        return Store(path, read_only=True)
    except StoreOlder:  # the file stays as it is; the copy is migrated and read
        return snapshot.SnapshotStore(path, migrate=True)
    except StoreBusy as busy:
        pid = busy.pid
    problem = ""
    for attempt in range(SNAPSHOT_ATTEMPTS):
        try:
            return snapshot.SnapshotStore(path, writer_pid=pid)
        except (OSError, StoreError, duckdb.Error) as exc:  # a copy torn by the writer, no room for it, ...
            problem = str(exc) or type(exc).__name__
            time.sleep(0.1 * (attempt + 1))
    raise StoreBusy(path, pid, why_no_snapshot=problem)
