"""A sidecar journal of runs, `<db>.runs.jsonl`, that notices when the database lost committed rows.

Why: DuckDB commits to a write-ahead log (`<db>.wal`) first and folds it into the database file at a
checkpoint. If the log is cut short (a full disk, a copy taken mid-write, a careless cleanup) DuckDB
replays what is left and drops the rest without a word: a run can vanish, and `--resume` then finds
"no unfinished run".

Design: the store appends one JSON line per event, fsynced, *after* the database committed it:
    {"event": "store"}                                  a new database file was created at this path
    {"event": "run", "run_id", "seq", "status", ...}    a run was created or changed status; seq counts
                                                        these changes and is stored in runs.status_seq
    {"event": "unit", "run_id", "arm", "workload", "unit_key"}   a unit of work finished
    {"event": "reported", "message"}                    a loss was reported by a writer; not repeated
Written after the commit, the journal never claims more than the database held, unless the database
lost committed writes. (A crash between commit and append leaves the journal behind, which is harmless.)
So when the store opens it compares: a run in the journal but not in the database was lost; a run whose
journal seq is ahead of the database lost its later status changes; units in the journal but not in the
database were lost (`--resume` redoes them). Only lines after the last "store" marker count, so a
database deleted on purpose and created anew does not inherit the old runs. A line torn by a kill is
skipped. The journal is never rewritten; a reader copies it before the database (snapshot.py), so it
cannot see events newer than its copy.
"""
from __future__ import annotations

import datetime as dt
import json
import os
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

WAL_LOST = "the write-ahead log was truncated (or the database was replaced by an older copy)"


def journal_path(db_path: str | Path) -> Path:
    return Path(str(db_path) + ".runs.jsonl")


@dataclass
class Audit:
    lost_runs: list[dict] = field(default_factory=list)   # rows shaped like Store.runs(), status "lost"
    warnings: list[str] = field(default_factory=list)     # losses not yet reported by a writer


class RunJournal:
    def __init__(self, path: str | Path):
        self.path = Path(path)

    def append(self, event: str, **fields: Any) -> None:
        """Append one event and fsync it (the file and, when it is new, its folder)."""
        record = {"event": event, "at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), **fields}
        line = json.dumps(record, sort_keys=True, default=str) + "\n"
        new = not self.path.exists()
        with open(self.path, "a+b") as fh:
            if fh.tell() > 0:  # a line torn by a kill must not swallow this one
                fh.seek(-1, os.SEEK_END)
                if fh.read(1) != b"\n":
                    line = "\n" + line
            fh.write(line.encode("utf-8"))
            fh.flush()
            os.fsync(fh.fileno())
        if new:
            _fsync_dir(self.path.parent)

    def events(self) -> list[dict]:
        """The events since the database at this path was created; torn or foreign lines are skipped."""
        try:
            raw = self.path.read_bytes()
        except OSError:
            return []
        out: list[dict] = []
        for line in raw.decode("utf-8", errors="replace").splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if not isinstance(record, dict):
                continue
            if record.get("event") == "store":
                out = []
            else:
                out.append(record)
        return out

    def audit(self, db_seq: dict[str, Optional[int]], db_units: set[tuple[str, str, str, str]]) -> Audit:
        """Compare the journal with the database: `db_seq` maps each run id in the database to its
        status_seq, `db_units` holds its finished units as (run_id, arm, workload, unit_key)."""
        runs: dict[str, dict] = {}
        units: dict[str, set] = defaultdict(set)
        reported: set[str] = set()
        for e in self.events():
            kind, rid = e.get("event"), e.get("run_id")
            if kind == "run" and rid and int(e.get("seq", 0)) >= int(runs.get(rid, {}).get("seq", 0)):
                runs[rid] = e
            elif kind == "unit" and rid:
                units[rid].add((rid, e.get("arm"), e.get("workload"), e.get("unit_key")))
            elif kind == "reported":
                reported.add(e.get("message"))
        audit = Audit()
        for rid, e in runs.items():
            if rid not in db_seq:
                error = f"lost: {WAL_LOST}; its rows are gone, rerun it"
                audit.lost_runs.append({"run_id": rid, "contract_name": e.get("contract_name"), "status": "lost",
                                        "verdict": None, "started_at": e.get("started_at"), "finished_at": None,
                                        "contract_fingerprint": e.get("contract_fingerprint"), "error": error})
                audit.warnings.append(f"run {rid} ({e.get('contract_name')}, started {e.get('started_at')}) was lost: "
                                      f"{WAL_LOST}; its rows are gone, rerun it")
                continue
            seq = db_seq[rid]
            if seq is not None and int(e.get("seq", 0)) > seq:
                audit.warnings.append(f"run {rid} lost its latest status change (to {e.get('status')!r} at "
                                      f"{e.get('at')}): {WAL_LOST}; check it with `onecat results show {rid}` "
                                      "and resume or rerun it")
            missing = units.get(rid, set()) - db_units
            if missing:
                audit.warnings.append(f"run {rid} lost {len(missing)} finished units: {WAL_LOST}; "
                                      "`onecat gate run --resume` redoes them")
        audit.warnings = [w for w in audit.warnings if w not in reported]
        return audit


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
