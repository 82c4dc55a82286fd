"""The DuckDB results store: every row is committed as it is produced, so kill -9 loses only the
request in flight, and `--resume` picks the run up where it stopped.

    store = Store(".onecat/results.duckdb")        # created / migrated on open (":memory:" for tests)
    store.create_run(RunRecord(...))                             # records: results/records.py
    store.add_environment(run_id, arm, Environment) / store.add_arm_outcome(run_id, arm, ArmOutcome)
    store.add_request(run_id, arm, workload, record, unit_key)   # RequestRecord
    store.add_item(run_id, arm, workload, outcome, request_key)  # ItemOutcome -> one row per measure
    store.add_metric(run_id, arm, workload, metric, unit_key, position)
    store.finish_unit(...) / store.done_units(run_id) / store.restart_unit(...)
    store.add_check(run_id, index, gate, result) / store.set_verdict(run_id, verdict, reason)
    store.requests(run_id, arm=None, workload=None) -> list[dict]   (also items(), metrics(), checks(), ...)
    store.query(sql) -> (columns, rows)                             SQL passthrough

Opening is where trouble is caught, and said plainly (errors.py): a file that is not a whole DuckDB
store raises StoreCorrupt and is left untouched (integrity.py); a store another process writes raises
StoreBusy (reading.open_for_reading then reads a snapshot), and a writer first waits a few seconds for
readers to close it. Every row is written with its columns named after the fields of its record
(records.py), never by position. A writer is recorded on its run row; when the
store is next opened for writing, `running` runs whose writer is gone become `interrupted` (liveness.py),
which `--resume` continues. Runs, status changes and finished units are also appended to a journal next
to the database, so a run the database lost (a truncated write-ahead log) is reported, never silently
forgotten (journal.py): `store.warnings` says what was lost, `store.lost_runs` lists the runs, and a
writer also logs the warnings (logger "onecat.results").
"""
from __future__ import annotations

import datetime as dt
import logging
import os
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Optional

import duckdb

from onecat.results.errors import NOTHING_CHANGED, StoreBusy, StoreCorrupt, StoreOlder, StoreTooNew, as_store_error
from onecat.results.integrity import check_extent, check_header
from onecat.results.journal import WAL_LOST, RunJournal, journal_path
from onecat.results.liveness import interrupted_reason, this_writer, writer_alive
from onecat.results.records import (METRIC_KINDS, ArmOutcome, Environment, ItemOutcome, Metric, RequestRecord,
                                    RunRecord, canonical_json, column_values)
from onecat.results.schema import MIGRATIONS

WRITER_WAITS_FOR_READERS_S = 10.0  # DuckDB lets no process write while another has the file open, even to read
RUN_LIST_COLUMNS = ("run_id", "kind", "contract_name", "status", "verdict", "started_at", "finished_at",
                    "contract_fingerprint", "contract_path", "error", "writer_pid", "writer_host", "writer_started")
log = logging.getLogger("onecat.results")


def _now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc).replace(tzinfo=None)


class Store:
    def __init__(self, path: str | Path, read_only: bool = False):
        self.path = str(path)
        self.read_only = read_only
        self.warnings: list[str] = []     # losses found by comparing the run journal with the database
        self.lost_runs: list[dict] = []   # runs the journal knows and the database lost (status "lost")
        self.snapshot_of: Optional[str] = None  # set when this is a copy of a store a run is writing
        in_memory = self.path == ":memory:"
        self.journal = None if in_memory else RunJournal(journal_path(self.path))
        created = False
        if not in_memory:
            check_header(self.path)
            created = not os.path.lexists(self.path)
            if not read_only:
                Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        self.con = self._connect()
        try:
            self._open(created)
        except BaseException as exc:
            self.con.close()
            mapped = as_store_error(self.path, exc)
            if mapped is not None and mapped is not exc:
                raise mapped from exc
            raise

    def _connect(self) -> duckdb.DuckDBPyConnection:
        """Open the file; a writer waits a little for readers (`results list`, `report`) to let go."""
        deadline = time.monotonic() + (0.0 if self.read_only else WRITER_WAITS_FOR_READERS_S)
        while True:
            try:
                return duckdb.connect(self.path, read_only=self.read_only)
            except duckdb.Error as exc:
                problem = as_store_error(self.path, exc) or exc
                if not isinstance(problem, StoreBusy):
                    raise problem from exc
                if time.monotonic() >= deadline:
                    raise StoreBusy(self.path, problem.pid, for_writing=not self.read_only) from exc
                time.sleep(0.2)

    def _open(self, created: bool) -> None:
        tables = self._tables()
        if tables and "schema_version" not in tables:
            raise StoreCorrupt(self.path, "is a DuckDB database but not a onecat results store (it holds "
                               + ", ".join(sorted(tables)[:5]) + ")",
                               f"{NOTHING_CHANGED}; pass the --db of a results store, or a new path to create one")
        if tables and self.path != ":memory:":
            check_extent(self.con, self.path)
        if self.read_only and tables and self.schema_version() < len(MIGRATIONS):
            raise StoreOlder(self.path, f"{self.path} has schema version {self.schema_version()}, older than this "
                                        f"onecat ({len(MIGRATIONS)}); a run writing it migrates it")
        if not self.read_only:
            self._migrate()
            if created:
                self._journal("store")
        self._run_columns = {r[0] for r in self.con.execute(
            "SELECT column_name FROM duckdb_columns() WHERE database_name = current_database()"
            " AND schema_name = 'main' AND table_name = 'runs'").fetchall()}
        self._audit()
        if not self.read_only:
            self._mark_orphaned_runs()

    def _tables(self) -> set[str]:
        return {r[0] for r in self.con.execute("SELECT table_name FROM duckdb_tables() WHERE"
                                               " database_name = current_database() AND schema_name = 'main'")
                .fetchall()}

    # ------------------------------------------------------------------ schema
    def _migrate(self) -> None:
        self.con.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL, applied_at TIMESTAMP)")
        current = self.schema_version()
        if current > len(MIGRATIONS):
            raise StoreTooNew(self.path, f"{self.path} has schema version {current}, newer than this onecat "
                                         f"({len(MIGRATIONS)}); upgrade onecat or use another --db")
        for version in range(current + 1, len(MIGRATIONS) + 1):
            self.con.execute("BEGIN TRANSACTION")
            for stmt in (s.strip() for s in MIGRATIONS[version - 1].split(";")):
                if stmt and not all(ln.strip().startswith("--") for ln in stmt.splitlines() if ln.strip()):
                    self.con.execute(stmt)
            self.con.execute("INSERT INTO schema_version VALUES (?, ?)", [version, _now()])
            self.con.execute("COMMIT")

    def schema_version(self) -> int:
        row = self.con.execute("SELECT max(version) FROM schema_version").fetchone()
        return int(row[0] or 0)

    def close(self) -> None:
        self.con.close()

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ journal, writers
    def _journal(self, event: str, **fields: Any) -> None:
        if self.journal is None:
            return
        try:
            self.journal.append(event, **fields)
        except OSError as exc:  # the store itself still works; only loss detection is weakened
            log.warning("cannot write the run journal %s (%s): a run lost by a truncated write-ahead log "
                        "would go unnoticed", self.journal.path, exc)

    def _audit(self) -> None:
        """Compare the run journal with the database; a writer logs new losses once."""
        if self.journal is None:
            return
        seq: dict[str, Optional[int]] = {}
        if "run_id" in self._run_columns:
            col = "status_seq" if "status_seq" in self._run_columns else "NULL"
            seq = {r[0]: r[1] for r in self.con.execute(f"SELECT run_id, {col} FROM runs").fetchall()}
        units = (set(self.con.execute("SELECT run_id, arm, workload, unit_key FROM units").fetchall())
                 if "units" in self._tables() else set())
        audit = self.journal.audit(seq, units)
        self.lost_runs, self.warnings = audit.lost_runs, audit.warnings
        if not self.read_only:
            for message in audit.warnings:
                log.warning(message)
                self._journal("reported", message=message)

    def _mark_orphaned_runs(self) -> None:
        """`running` runs whose writer is gone become `interrupted`. Holding the write lock means no other
        process writes this store, so a run without a recorded writer is an orphan too."""
        rows = self._dicts("SELECT run_id, contract_path, writer_pid, writer_host, writer_started FROM runs"
                           " WHERE status = 'running'")
        for row in rows:
            if row["writer_pid"] is None or writer_alive(row["writer_pid"], row["writer_host"],
                                                         row["writer_started"]) is False:
                self.set_status(row["run_id"], "interrupted", interrupted_reason(row))

    def _settle(self, row: dict) -> dict:
        """A read-only view cannot record that a run's writer is gone, but it can show it."""
        if row.get("status") == "running" and row.get("writer_pid") is not None and writer_alive(
                row["writer_pid"], row.get("writer_host"), row.get("writer_started")) is False:
            row["status"], row["error"] = "interrupted", interrupted_reason(row)
        return row

    # ------------------------------------------------------------------ runs
    def create_run(self, run: RunRecord) -> None:
        started, writer = _now(), this_writer()
        self._insert("runs", {**column_values(run), "status": "running", "started_at": started, **writer,
                              "status_seq": 1})
        self._journal("run", run_id=run.run_id, seq=1, status="running", contract_name=run.contract_name,
                      contract_fingerprint=run.contract_fingerprint, contract_path=run.contract_path,
                      started_at=started)

    def set_status(self, run_id: str, status: str, error: Optional[str] = None) -> None:
        """Change a run's status; `running` also records the current process as its writer."""
        finished = _now() if status in ("complete", "failed", "interrupted") else None
        sets = "status = ?, error = ?, finished_at = ?, status_seq = coalesce(status_seq, 0) + 1"
        params: list[Any] = [status, error, finished]
        if status == "running":
            writer = this_writer()
            sets += ", writer_pid = ?, writer_host = ?, writer_started = ?"
            params += [writer["writer_pid"], writer["writer_host"], writer["writer_started"]]
        row = self.con.execute(f"UPDATE runs SET {sets} WHERE run_id = ? RETURNING status_seq, contract_name,"
                               " contract_fingerprint, contract_path, started_at", params + [run_id]).fetchone()
        if row:
            self._journal("run", run_id=run_id, seq=row[0], status=status, contract_name=row[1],
                          contract_fingerprint=row[2], contract_path=row[3], started_at=row[4])

    @contextmanager
    def recording_stops(self, run_id: str, interrupted_note: str) -> Iterator[None]:
        """A run whose work stops early says so: Ctrl-C -> interrupted (with `interrupted_note`), an error ->
        failed (with the error); either way the exception goes on."""
        try:
            yield
        except KeyboardInterrupt:
            self.set_status(run_id, "interrupted", interrupted_note)
            raise
        except BaseException as exc:
            self.set_status(run_id, "failed", f"{type(exc).__name__}: {exc}")
            raise

    def run(self, run_id: str) -> Optional[dict]:
        rows = self._dicts("SELECT * FROM runs WHERE run_id = ?", [run_id]) if self._run_columns else []
        return self._settle(rows[0]) if rows else None

    def runs(self, limit: int = 50) -> list[dict]:
        """Newest first, with the runs the journal knows and the database lost (status "lost")."""
        rows: list[dict] = []
        if self._run_columns:
            cols = ", ".join(c for c in RUN_LIST_COLUMNS if c in self._run_columns)
            rows = [self._settle(r) for r in
                    self._dicts(f"SELECT {cols} FROM runs ORDER BY started_at DESC LIMIT ?", [limit])]
        rows += [dict(r) for r in self.lost_runs]
        rows.sort(key=lambda r: str(r.get("started_at") or ""), reverse=True)
        return rows[:limit]

    def latest_unfinished(self, contract_fingerprint: str) -> Optional[str]:
        """The newest run of this contract that `--resume` can continue: running (its writer may have died
        on another host), interrupted (killed, crashed, Ctrl-C) or failed."""
        row = self.con.execute("SELECT run_id FROM runs WHERE contract_fingerprint = ? AND status IN"
                               " ('running', 'interrupted', 'failed') ORDER BY started_at DESC LIMIT 1",
                               [contract_fingerprint]).fetchone()
        return row[0] if row else None

    def resolve_run_id(self, run_id: Optional[str]) -> str:
        """`None` or "latest" -> the newest run; a unique prefix -> the full id."""
        has_runs = bool(self._run_columns)
        if run_id in (None, "latest"):
            row = self.con.execute("SELECT run_id FROM runs ORDER BY started_at DESC LIMIT 1").fetchone() \
                if has_runs else None
            if not row:
                raise LookupError(f"no runs in {self.path}")
            return row[0]
        rows = self.con.execute("SELECT run_id FROM runs WHERE run_id LIKE ?", [run_id + "%"]).fetchall() \
            if has_runs else []
        exact = [r[0] for r in rows if r[0] == run_id]
        if exact:
            return exact[0]
        lost = [r["run_id"] for r in self.lost_runs if r["run_id"].startswith(run_id)]
        if not rows and lost:
            raise LookupError(f"run {lost[0]} was lost: {WAL_LOST}; its rows are gone, rerun it")
        if len(rows) != 1:
            raise LookupError(f"run {run_id!r} matches {len(rows)} runs in {self.path}"
                              + ("" if rows else "; see `onecat results list`"))
        return rows[0][0]

    # ------------------------------------------------------------------ rows
    def _insert(self, table: str, values: dict[str, Any], replace: bool = False) -> None:
        """One row, its columns named: a value can only land in the column of its own name."""
        cols = ", ".join(values)
        self.con.execute(f"INSERT {'OR REPLACE ' if replace else ''}INTO {table} ({cols})"
                         f" VALUES ({', '.join('?' for _ in values)})", list(values.values()))

    def add_environment(self, run_id: str, arm: str, env: Environment) -> None:
        self._insert("environment", {"run_id": run_id, "arm": arm, **column_values(env), "recorded_at": _now()},
                     replace=True)

    def add_arm_outcome(self, run_id: str, arm: str, outcome: ArmOutcome) -> None:
        self._insert("arm_outcomes", {"run_id": run_id, "arm": arm, **column_values(outcome),
                                      "recorded_at": _now()}, replace=True)

    def add_request(self, run_id: str, arm: str, workload: str, rec: RequestRecord,
                    unit_key: Optional[str] = None) -> None:
        self._insert("requests", {"run_id": run_id, "arm": arm, "workload": workload, "unit_key": unit_key,
                                  **column_values(rec), "recorded_at": _now()}, replace=True)

    def request_keys(self, run_id: str, arm: str, workload: str) -> set[str]:
        rows = self.con.execute("SELECT request_key FROM requests WHERE run_id = ? AND arm = ? AND workload = ?",
                                [run_id, arm, workload]).fetchall()
        return {r[0] for r in rows}

    def add_item(self, run_id: str, arm: str, workload: str, outcome: ItemOutcome,
                 request_key: Optional[str] = None) -> None:
        if not outcome.passed:
            raise ValueError(f"item {outcome.item_id}: ItemOutcome.passed needs at least one measure")
        row = {"run_id": run_id, "arm": arm, "workload": workload, **column_values(outcome, exclude=("passed",)),
               "request_key": request_key, "recorded_at": _now()}
        row["item_id"] = str(outcome.item_id)
        row["seed"] = -1 if outcome.seed is None else outcome.seed  # part of the key: never NULL
        self.con.execute("BEGIN TRANSACTION")
        try:
            for measure, ok in outcome.passed.items():
                self._insert("item_outcomes", {**row, "measure": measure, "passed": bool(ok)}, replace=True)
            self.con.execute("COMMIT")
        except Exception:
            self.con.execute("ROLLBACK")
            raise

    def add_metric(self, run_id: str, arm: str, workload: str, m: Metric, unit_key: Optional[str] = None,
                   position: Optional[int] = None) -> None:
        if m.kind not in METRIC_KINDS:
            raise ValueError(f"metric {m.name}: kind must be 'measured' or 'projected', got {m.kind!r}")
        self._insert("metrics", {"run_id": run_id, "arm": arm, "workload": workload, "unit_key": unit_key,
                                 **column_values(m), "value": float(m.value), "position": position,
                                 "recorded_at": _now()})

    def restart_unit(self, run_id: str, arm: str, workload: str, unit_key: str) -> None:
        """Drop aggregate rows of a unit that was cut short, so re-running it does not double count."""
        self.con.execute("DELETE FROM metrics WHERE run_id = ? AND arm = ? AND workload = ? AND unit_key = ?",
                         [run_id, arm, workload, unit_key])

    def finish_unit(self, run_id: str, arm: str, workload: str, unit_key: str, position: Optional[int] = None) -> None:
        self._insert("units", {"run_id": run_id, "arm": arm, "workload": workload, "unit_key": unit_key,
                               "position": position, "finished_at": _now()}, replace=True)
        self._journal("unit", run_id=run_id, arm=arm, workload=workload, unit_key=unit_key)

    def done_units(self, run_id: str) -> set[tuple[str, str, str]]:
        rows = self.con.execute("SELECT arm, workload, unit_key FROM units WHERE run_id = ?", [run_id]).fetchall()
        return {tuple(r) for r in rows}

    def add_check(self, run_id: str, index: int, gate: Any, result: Any) -> None:
        """A gate (its `id`, `check`, `workload`, `informative`, settings) and its CheckResult."""
        self._insert("checks", {
            "run_id": run_id, "gate_index": index, "gate_id": gate.id, "check_name": gate.check,
            "workload": getattr(gate, "workload", None), "status": result.status, "informative": gate.informative,
            "summary": result.summary, "statistic_json": canonical_json(result.statistic),
            "evidence_json": canonical_json(result.evidence),
            "config_json": canonical_json(gate.model_dump(mode="json")), "recorded_at": _now()}, replace=True)

    def clear_checks(self, run_id: str) -> None:
        self.con.execute("DELETE FROM checks WHERE run_id = ?", [run_id])

    def set_verdict(self, run_id: str, verdict: str, reason: str) -> None:
        self._insert("verdicts", {"run_id": run_id, "verdict": verdict, "reason": reason, "recorded_at": _now()},
                     replace=True)
        self.con.execute("UPDATE runs SET verdict = ? WHERE run_id = ?", [verdict, run_id])

    # ------------------------------------------------------------------ queries
    def _dicts(self, sql: str, params: list | None = None) -> list[dict]:
        cur = self.con.execute(sql, params or [])
        cols = [d[0] for d in cur.description]
        return [dict(zip(cols, row)) for row in cur.fetchall()]

    def _select(self, table: str, run_id: str, arm: Optional[str], workload: Optional[str], order: str) -> list[dict]:
        sql, params = f"SELECT * FROM {table} WHERE run_id = ?", [run_id]
        if arm is not None:
            sql, params = sql + " AND arm = ?", params + [arm]
        if workload is not None:
            sql, params = sql + " AND workload = ?", params + [workload]
        return self._dicts(sql + f" ORDER BY {order}", params)

    def requests(self, run_id: str, arm: Optional[str] = None, workload: Optional[str] = None) -> list[dict]:
        return self._select("requests", run_id, arm, workload, "arm, workload, request_key")

    def items(self, run_id: str, arm: Optional[str] = None, workload: Optional[str] = None) -> list[dict]:
        return self._select("item_outcomes", run_id, arm, workload, "arm, workload, item_id, seed, measure")

    def metrics(self, run_id: str, arm: Optional[str] = None, workload: Optional[str] = None,
                name: Optional[str] = None) -> list[dict]:
        rows = self._select("metrics", run_id, arm, workload, "arm, workload, name, key, repeat, position")
        return [r for r in rows if name is None or r["name"] == name]

    def environment(self, run_id: str) -> list[dict]:
        return self._dicts("SELECT * FROM environment WHERE run_id = ? ORDER BY arm", [run_id])

    def arm_outcomes(self, run_id: str) -> list[dict]:
        return self._dicts("SELECT * FROM arm_outcomes WHERE run_id = ? ORDER BY arm", [run_id])

    def checks(self, run_id: str) -> list[dict]:
        return self._dicts("SELECT * FROM checks WHERE run_id = ? ORDER BY gate_index", [run_id])

    def verdict(self, run_id: str) -> Optional[dict]:
        rows = self._dicts("SELECT * FROM verdicts WHERE run_id = ?", [run_id])
        return rows[0] if rows else None

    def query(self, sql: str, params: list | None = None) -> tuple[list[str], list[tuple]]:
        cur = self.con.execute(sql, params or [])
        if cur.description is None:
            return [], []
        return [d[0] for d in cur.description], cur.fetchall()
