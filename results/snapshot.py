"""Reading a store while a run writes it: open a consistent copy.

DuckDB lets one process write a database file and no other process open it, not even read-only. A
reader therefore copies the run journal, the database file and its write-ahead log into a temporary
folder and opens the copy read-only; DuckDB replays the copied log in memory, and an entry the writer
was still appending is ignored. The journal is copied first: the writer appends to it only after a
commit, so every event in the copy is backed by the database or log copied after it.

A copy is consistent when the database file did not change while it was copied: its size, inode,
mtime and header (DuckDB writes a new header at the end of every checkpoint) are compared before and
after, and a checkpoint in between means another try. The log may only grow meanwhile. The copy lives
in the system temp folder (or next to the store when that has too little room) and is removed on close.
"""
from __future__ import annotations

import datetime as dt
import shutil
import tempfile
import time
from pathlib import Path
from typing import Optional

from onecat.results.integrity import HEADER_BYTES
from onecat.results.journal import journal_path
from onecat.results.store import Store

ATTEMPTS = 6


class SnapshotChanged(OSError):
    """The database kept changing (checkpoints) while it was being copied."""


def _state(path: Path) -> Optional[tuple]:
    try:
        st = path.stat()
        with open(path, "rb") as fh:
            head = fh.read(HEADER_BYTES)
    except FileNotFoundError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns, head


def _copy_if_present(src: Path, dest: Path) -> None:
    try:
        shutil.copyfile(src, dest)
    except FileNotFoundError:
        pass


def copy_store_files(db: str | Path, dest_dir: str | Path) -> Path:
    """Copy journal, database and write-ahead log of `db` into `dest_dir` so that they fit together;
    returns the copied database's path."""
    db, dest_dir = Path(db), Path(dest_dir)
    wal = Path(str(db) + ".wal")
    dest = dest_dir / db.name
    for attempt in range(ATTEMPTS):
        db_before, wal_before = _state(db), _state(wal)
        _copy_if_present(journal_path(db), journal_path(dest))
        shutil.copyfile(db, dest)
        _copy_if_present(wal, Path(str(dest) + ".wal"))
        db_after, wal_after = _state(db), _state(wal)
        wal_grew_only = (wal_before is None or wal_after is not None and wal_after[0] == wal_before[0]
                         and wal_after[1] >= wal_before[1])
        if db_after == db_before and wal_grew_only:
            return dest
        for leftover in (Path(str(dest) + ".wal"), journal_path(dest)):
            leftover.unlink(missing_ok=True)
        time.sleep(0.05 * (attempt + 1))
    raise SnapshotChanged(f"{db} changed during {ATTEMPTS} attempts to copy it")


def _scratch_dir(db: Path) -> Path:
    need = sum(p.stat().st_size for p in (db, Path(str(db) + ".wal"), journal_path(db)) if p.exists())
    base = Path(tempfile.gettempdir())
    if shutil.disk_usage(base).free < 2 * need + (64 << 20):
        base = db.parent
    return Path(tempfile.mkdtemp(prefix="onecat-snapshot-", dir=base))


class SnapshotStore(Store):
    """A Store over a copy of a store that a run is writing (or, with `migrate`, of a store with an older
    schema: the copy is migrated); the copy goes away on close."""

    def __init__(self, db: str | Path, writer_pid: Optional[int] = None, migrate: bool = False):
        db = Path(db)
        self._scratch = _scratch_dir(db)
        self.migrated = migrate
        try:
            copy = copy_store_files(db, self._scratch)
            super().__init__(copy, read_only=not migrate)
        except BaseException:
            shutil.rmtree(self._scratch, ignore_errors=True)
            raise
        self.path = self.snapshot_of = str(db)  # messages name the store, not its copy
        self.writer_pid = writer_pid
        self.taken_at = dt.datetime.now()

    def describe(self) -> str:
        if self.migrated:
            return (f"{self.snapshot_of} has an older schema: read from an upgraded copy; the file itself is "
                    "upgraded when a run next writes it")
        who = f" (pid {self.writer_pid})" if self.writer_pid else ""
        return (f"snapshot while a run is writing{who}: {self.snapshot_of} as of "
                f"{self.taken_at:%H:%M:%S}; rows written later are not shown")

    def close(self) -> None:
        try:
            super().close()
        finally:
            shutil.rmtree(self._scratch, ignore_errors=True)

