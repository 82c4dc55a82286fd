"""The results store under hostile conditions: a live writer, kill -9, damaged files, a truncated WAL.

Every subprocess here is bounded by a timeout; writers are killed in `finally`.
"""
import json
import logging
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import duckdb
import pytest

import gate_fakes
from onecat.gates.contract import load_contract
from onecat.gates.gate_run import ResumeError, gate_run_record, run_gate
from onecat.results.schema import MIGRATIONS
from onecat.results.store import Store

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
NOTHING_CHANGED = "Nothing was changed"


def new_run(store, run_id, contract):
    arms = {a: contract.arm(a) for a in ("baseline", "candidate")}
    store.create_run(gate_run_record(run_id, contract, None, arms, {}, "e", "h", "0"))


def onecat(*args, timeout=60):
    """`onecat ARGS` in a fresh process (the store lock is per process)."""
    return subprocess.run([sys.executable, "-m", "onecat.cli.main", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT)


class Writer:
    """tests/store_writer.py in a subprocess: holds the store open for writing until killed."""

    def __init__(self, db, contract, run_id, *extra):
        self.proc = subprocess.Popen([sys.executable, str(HERE / "store_writer.py"), str(db), str(contract), run_id,
                                      *map(str, extra)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        self.pid = self.proc.pid
        deadline, out = time.time() + 60, b""
        while b"ready" not in out:
            if self.proc.poll() is not None or time.time() > deadline:
                self.kill()
                pytest.fail("store writer did not start: " + (out + self.proc.stdout.read()).decode()[-2000:])
            if select.select([self.proc.stdout], [], [], 0.5)[0]:
                out += os.read(self.proc.stdout.fileno(), 4096)

    def kill(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.kill()


@pytest.fixture
def contract(tmp_path):
    return gate_fakes.write_fake_contract(tmp_path)


def _no_traceback(res):
    text = res.stdout + res.stderr
    assert "Traceback" not in text and "Exception" not in text, text


# --------------------------------------------------------------------------- a run is writing
def test_results_commands_read_a_snapshot_while_a_run_writes(tmp_path, contract):
    from typer.testing import CliRunner

    from onecat.cli.main import app

    db = tmp_path / "r.duckdb"
    scratch = Path(tempfile.gettempdir())
    snapshots_before = set(scratch.glob("onecat-snapshot-*"))
    with Writer(db, contract, "run-live", "--checkpoint-every", "25"):
        for _ in range(2):  # the writer keeps committing and checkpointing meanwhile
            res = onecat("results", "list", "--db", db)
            _no_traceback(res)
            assert res.returncode == 0, res.stderr
            assert "run-live" in res.stdout and "running" in res.stdout
            assert "snapshot while a run is writing" in res.stderr
        runner = CliRunner()  # the lock is another process's, so in-process reads meet it the same way
        show = runner.invoke(app, ["results", "show", "run-live", "--db", str(db)])
        assert show.exit_code == 0 and "run-live" in show.stdout, show.output
        q = runner.invoke(app, ["results", "query", "SELECT count(*) AS n FROM requests", "--db", str(db),
                                "--format", "json"])
        assert q.exit_code == 0 and json.loads(q.stdout)[0]["n"] > 0, q.output  # the label goes to stderr
        assert "snapshot while a run is writing" in q.stderr
        rep = runner.invoke(app, ["report", "run-live", "--db", str(db), "--out", str(tmp_path / "live.md")])
        assert rep.exit_code == 0 and (tmp_path / "live.md").is_file(), rep.output
    assert set(scratch.glob("onecat-snapshot-*")) <= snapshots_before  # copies are removed on close


def test_busy_store_without_a_snapshot_names_the_writer(tmp_path, contract, monkeypatch):
    from typer.testing import CliRunner

    from onecat.cli.main import app
    from onecat.results import snapshot
    from onecat.results.errors import StoreBusy
    from onecat.results.reading import open_for_reading

    def no_copy(*a, **k):
        raise OSError("no space left on device")

    monkeypatch.setattr(snapshot, "copy_store_files", no_copy)
    db = tmp_path / "r.duckdb"
    with Writer(db, contract, "run-live") as w:
        with pytest.raises(StoreBusy, match=f"busy: a run \\(pid {w.pid}\\) is writing it"):
            open_for_reading(db)
        res = CliRunner().invoke(app, ["results", "list", "--db", str(db)])
        assert res.exit_code == 4 and "try again when it finishes" in res.output and "Traceback" not in res.output


def test_a_writer_waits_for_a_reader_to_let_go(tmp_path, contract, monkeypatch):
    from onecat.results import store as store_module

    db = tmp_path / "r.duckdb"
    Store(db).close()
    hold = f"import duckdb, time; c = duckdb.connect({str(db)!r}, read_only=True); print('ready', flush=True); " \
           "time.sleep(2)"
    reader = subprocess.Popen([sys.executable, "-c", hold], stdout=subprocess.PIPE)
    try:
        assert reader.stdout.readline().strip() == b"ready"
        t0 = time.monotonic()
        with Store(db) as s:  # `results list` in another shell must not fail a `gate run` starting now
            assert s.schema_version() == len(MIGRATIONS)
        assert time.monotonic() - t0 > 0.5
    finally:
        reader.kill()
        reader.wait(timeout=30)
    monkeypatch.setattr(store_module, "WRITER_WAITS_FOR_READERS_S", 0.5)
    with Writer(db, contract, "run-live") as w:  # a second writer gives up with a message
        with pytest.raises(RuntimeError, match=f"is in use: another process \\(pid {w.pid}\\)"):  # StoreBusy
            Store(db)


# --------------------------------------------------------------------------- damaged files
@pytest.fixture(scope="module")
def good_store_bytes(tmp_path_factory) -> bytes:
    """A store with enough rows to span several DuckDB blocks."""
    tmp = tmp_path_factory.mktemp("good")
    src = tmp / "good.duckdb"
    c = load_contract(gate_fakes.write_fake_contract(tmp))
    with Store(src) as s:
        new_run(s, "r-good", c)
        s.con.execute("INSERT INTO requests (run_id, arm, workload, request_key, token_sha256, recorded_at)"
                      " SELECT 'r-good', 'baseline', 'w', 'k' || i, md5(i::VARCHAR), now() FROM range(60000) t(i)")
    return src.read_bytes()


DAMAGE = {
    "random bytes": lambda good: os.urandom(len(good)),
    "truncated": lambda good: good[: len(good) // 2],
    "cut inside the header": lambda good: good[:100],
    "a text file": lambda good: b"name: this is not a database\n" * 50,
    "an SQLite file": lambda good: b"SQLite format 3\x00" + bytes(4080),
    "empty": lambda good: b"",
    "a damaged block": lambda good: good[:12288] + os.urandom(8192) + good[20480:],
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damaged_store_gives_a_clear_error_and_is_left_alone(tmp_path, contract, damage, good_store_bytes):
    from typer.testing import CliRunner

    from onecat.cli.main import app

    db = tmp_path / "r.duckdb"
    db.write_bytes(DAMAGE[damage](good_store_bytes))
    before = db.read_bytes()
    res = onecat("results", "list", "--db", db)  # as a user runs it
    _no_traceback(res)
    assert res.returncode == 4, (res.stdout, res.stderr)
    assert str(db) in res.stderr and NOTHING_CHANGED in res.stderr, res.stderr
    out = ["--out", str(tmp_path / "out")]
    for args in (["results", "show"], ["results", "query", "SELECT * FROM runs"], ["results", "export", *out],
                 ["report", *out]):
        res = CliRunner().invoke(app, [*args, "--db", str(db)])
        assert res.exit_code == 4 and NOTHING_CHANGED in res.output and str(db) in res.output, (args, res.output)
    with pytest.raises(RuntimeError, match=NOTHING_CHANGED):  # StoreCorrupt
        Store(db)
    res = CliRunner().invoke(app, ["gate", "run", str(contract), "--db", str(db), "--no-progress",
                                   "--out", str(tmp_path / "rep")])
    assert res.exit_code == 4 and NOTHING_CHANGED in res.output, res.output
    assert db.read_bytes() == before
    assert not Path(str(db) + ".wal").exists()


def test_a_foreign_duckdb_file_is_not_taken_over(tmp_path):
    db = tmp_path / "mine.duckdb"
    con = duckdb.connect(str(db))
    con.execute("CREATE TABLE sales (id INTEGER)")
    con.close()
    res = onecat("results", "list", "--db", db)
    _no_traceback(res)
    assert res.returncode == 4 and "not a onecat results store" in res.stderr
    with pytest.raises(RuntimeError, match="not a onecat results store"):  # StoreCorrupt
        Store(db)
    con = duckdb.connect(str(db), read_only=True)
    assert [t[0] for t in con.execute("SHOW TABLES").fetchall()] == ["sales"]
    con.close()


# --------------------------------------------------------------------------- kill -9
def test_a_killed_writer_leaves_an_interrupted_run_that_resume_continues(tmp_path, contract):
    db = tmp_path / "r.duckdb"
    w = Writer(db, contract, "run-killed", "--units", "2")
    w.kill()
    assert w.proc.returncode == -signal.SIGKILL

    listing = onecat("results", "list", "--db", db)  # read-only: shows it, changes nothing
    _no_traceback(listing)
    assert listing.returncode == 0 and "interrupted" in listing.stdout, listing.stdout

    fingerprint = load_contract(contract).fingerprint
    with Store(db) as s:  # the next open for writing records what happened
        row = s.run("run-killed")
        assert row["status"] == "interrupted", row
        assert row["writer_pid"] == w.pid and row["writer_host"]
        assert "killed" in row["error"] and "--resume" in row["error"]
        assert s.latest_unfinished(fingerprint) == "run-killed"
    outcome = run_gate(contract, db, resume=True, report_dir=tmp_path)
    assert outcome.run_id == "run-killed"
    with Store(db) as s:
        assert s.run("run-killed")["status"] == "complete"


def test_only_runs_whose_writer_is_gone_are_marked(tmp_path, contract):
    c = load_contract(contract)
    arms = {a: c.arm(a) for a in ("baseline", "candidate")}
    db = tmp_path / "r.duckdb"
    s = Store(db)
    for rid in ("mine", "pid-reused", "elsewhere"):
        s.create_run(gate_run_record(rid, c, None, arms, {}, "e", "h", "0"))
    s.con.execute("UPDATE runs SET writer_started = 'another-boot/1' WHERE run_id = 'pid-reused'")
    s.con.execute("UPDATE runs SET writer_host = 'some-other-host' WHERE run_id = 'elsewhere'")
    with Store(db) as again:  # this process still writes "mine"
        status = {r["run_id"]: r["status"] for r in again.runs()}
    assert status == {"mine": "running", "pid-reused": "interrupted", "elsewhere": "running"}
    s.close()


def test_a_store_from_before_writer_tracking_is_migrated(tmp_path):
    db = tmp_path / "v1.duckdb"
    con = duckdb.connect(str(db))
    con.execute("CREATE TABLE schema_version (version INTEGER NOT NULL, applied_at TIMESTAMP)")
    con.execute(MIGRATIONS[0])
    con.execute("INSERT INTO schema_version VALUES (1, now())")
    con.execute("INSERT INTO runs (run_id, contract_name, contract_fingerprint, contract_json, status, started_at)"
                " VALUES ('old', 'c', 'f', '{}', 'running', now())")
    con.close()
    listing = onecat("results", "list", "--db", db)
    assert listing.returncode == 0 and "old" in listing.stdout, listing.stderr
    with Store(db) as s:
        assert s.schema_version() == len(MIGRATIONS)
        row = s.run("old")
        assert row["status"] == "interrupted" and "--resume" in row["error"]


# --------------------------------------------------------------------------- truncated WAL
def test_a_run_lost_to_a_truncated_wal_is_reported(tmp_path, contract, caplog):
    db = tmp_path / "r.duckdb"
    Store(db).close()  # the schema is checkpointed into the file; the run will live only in the WAL
    Writer(db, contract, "run-lost", "--units", "3").kill()
    wal = Path(str(db) + ".wal")
    assert wal.stat().st_size > 0
    with open(wal, "r+b") as fh:
        fh.truncate(10)

    listing = onecat("results", "list", "--db", db)
    _no_traceback(listing)
    assert listing.returncode == 0 and "run-lost" in listing.stdout and "lost" in listing.stdout
    assert "run run-lost" in listing.stderr and "write-ahead log was truncated" in listing.stderr

    with caplog.at_level(logging.WARNING, logger="onecat.results"):
        with pytest.raises(ResumeError, match="no unfinished run.*run run-lost of this contract was lost"):
            run_gate(contract, db, resume=True, report_dir=tmp_path)
    assert any("run-lost" in r.getMessage() and "rerun it" in r.getMessage() for r in caplog.records)
    with Store(db) as s:
        assert [r["run_id"] for r in s.lost_runs] == ["run-lost"]
        assert [r["status"] for r in s.runs() if r["run_id"] == "run-lost"] == ["lost"]
    show = onecat("results", "show", "run-lost", "--db", db)
    assert show.returncode == 2 and "lost" in show.stderr


def test_finished_units_lost_to_a_truncated_wal_are_reported(tmp_path, contract):
    db = tmp_path / "r.duckdb"
    c = load_contract(contract)
    with Store(db) as s:
        new_run(s, "run-1", c)
    Writer(db, contract, "run-1", "--existing", "--units", "3").kill()
    with open(Path(str(db) + ".wal"), "r+b") as fh:
        fh.truncate(0)
    with Store(db) as s:
        assert s.run("run-1") is not None and not s.done_units("run-1")
        assert any("run-1" in w and "3 finished units" in w for w in s.warnings), s.warnings


def test_a_status_change_lost_to_a_truncated_wal_is_reported(tmp_path, contract):
    db = tmp_path / "r.duckdb"
    c = load_contract(contract)
    with Store(db) as s:
        new_run(s, "run-1", c)
    Writer(db, contract, "run-1", "--existing", "--status", "complete").kill()
    with open(Path(str(db) + ".wal"), "r+b") as fh:
        fh.truncate(0)
    with Store(db) as s:
        assert s.run("run-1")["status"] != "complete"
        assert any("run-1 lost its latest status change (to 'complete'" in w for w in s.warnings), s.warnings
    with Store(db) as s:  # reported once by a writer, then only listed
        assert s.warnings == []


def test_a_new_store_at_the_same_path_does_not_inherit_old_losses(tmp_path, contract):
    db = tmp_path / "r.duckdb"
    c = load_contract(contract)
    with Store(db) as s:
        new_run(s, "old", c)
    db.unlink()  # deliberately removed; its journal stays behind
    with Store(db) as s:
        assert s.lost_runs == [] and s.warnings == []
    with open(Path(str(db) + ".runs.jsonl"), "a") as fh:
        fh.write('{"event": "run", "run_id": "to')  # a line torn by kill -9 is skipped
    with Store(db) as s:
        assert s.lost_runs == [] and s.warnings == []


def test_a_checkpoint_during_the_snapshot_copy_means_another_copy(tmp_path, contract, monkeypatch):
    from onecat.results import snapshot

    db = tmp_path / "r.duckdb"
    c = load_contract(contract)
    live = Store(db)
    new_run(live, "run-1", c)
    real_copy, copies = shutil.copyfile, []

    def copy_then_checkpoint(src, dst, **kw):
        out = real_copy(src, dst, **kw)
        if Path(src) == db:
            copies.append(dst)
            if len(copies) == 1:  # the writer checkpoints while the reader copies
                live.set_status("run-1", "complete")
                live.con.execute("CHECKPOINT")
        return out

    monkeypatch.setattr(snapshot.shutil, "copyfile", copy_then_checkpoint)
    (tmp_path / "copy").mkdir()
    copy = snapshot.copy_store_files(db, tmp_path / "copy")
    live.close()
    assert len(copies) == 2
    with Store(copy, read_only=True) as s:
        assert s.run("run-1")["status"] == "complete" and s.warnings == []
