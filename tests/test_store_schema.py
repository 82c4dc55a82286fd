"""The store's tables hold exactly the fields of their record types (results/records.py), each value lands
in the column of its own name, and a store written by an older schema migrates and reads back."""
import dataclasses
import json

import duckdb
import pytest

from onecat.gates.checks.base import PASS, Evidence
from onecat.gates.checks.token_hash_equal import TokenHashEqual
from onecat.results.reading import open_for_reading
from onecat.results.records import (ArmOutcome, Environment, ItemOutcome, Metric, RequestRecord, RunRecord,
                                    column_values, record_columns)
from onecat.results.schema import MIGRATIONS
from onecat.results.store import Store

STORE_OWNED_RUN_COLUMNS = {"status", "verdict", "error", "started_at", "finished_at", "writer_pid", "writer_host",
                           "writer_started", "status_seq"}
# table -> (record type, record fields stored otherwise, columns the store adds around the record)
TABLES = {
    "runs": (RunRecord, (), STORE_OWNED_RUN_COLUMNS),
    "environment": (Environment, (), {"run_id", "arm", "recorded_at"}),
    "arm_outcomes": (ArmOutcome, (), {"run_id", "arm", "recorded_at"}),
    "requests": (RequestRecord, (), {"run_id", "arm", "workload", "unit_key", "recorded_at"}),
    "item_outcomes": (ItemOutcome, ("passed",),
                      {"run_id", "arm", "workload", "measure", "passed", "request_key", "recorded_at"}),
    "metrics": (Metric, (), {"run_id", "arm", "workload", "unit_key", "position", "recorded_at"}),
}


def _columns(store: Store, table: str) -> list[str]:
    return [r[0] for r in store.con.execute("SELECT column_name FROM duckdb_columns() WHERE table_name = ?",
                                            [table]).fetchall()]


@pytest.mark.parametrize("table", sorted(TABLES))
def test_table_columns_are_the_record_fields(table):
    record_type, stored_otherwise, around = TABLES[table]
    with Store(":memory:") as store:
        columns = _columns(store, table)
    assert len(columns) == len(set(columns))
    assert set(columns) == set(record_columns(record_type, exclude=stored_otherwise)) | around


def _distinct_values(record_type, **fixed):
    """An instance whose every field holds a value no other field holds, so a value in a wrong column shows."""
    values = {}
    for i, f in enumerate(dataclasses.fields(record_type)):
        kind = str(f.type)
        values[f.name] = (fixed[f.name] if f.name in fixed else {"k": i} if kind.startswith("dict")
                          else [i] if kind.startswith("list") else i % 2 == 0 if "bool" in kind
                          else float(i) + 0.5 if "float" in kind else 1000 + i if "int" in kind else f"v{i}")
    return record_type(**values)


def test_every_field_reads_back_from_its_own_column():
    records = {
        "runs": _distinct_values(RunRecord, kind="compare"),
        "environment": _distinct_values(Environment),
        "arm_outcomes": _distinct_values(ArmOutcome, status="failed"),
        "requests": _distinct_values(RequestRecord),
        "metrics": _distinct_values(Metric, kind="projected"),
    }
    with Store(":memory:") as store:
        run_id = records["runs"].run_id
        store.create_run(records["runs"])
        store.add_environment(run_id, "a", records["environment"])
        store.add_arm_outcome(run_id, "a", records["arm_outcomes"])
        store.add_request(run_id, "a", "w", records["requests"], "u")
        store.add_metric(run_id, "a", "w", records["metrics"], "u", 3)
        store.add_item(run_id, "a", "w", ItemOutcome("i", {"m": True}, seed=7, failure_reason="f",
                                                     extracted_answer="x", extra={"e": 1}), "rk")
        rows = {"runs": [store.run(run_id)], "environment": store.environment(run_id),
                "arm_outcomes": store.arm_outcomes(run_id), "requests": store.requests(run_id),
                "metrics": store.metrics(run_id)}
        item, = store.items(run_id)
    for table, record in records.items():
        row, = rows[table]
        assert {c: row[c] for c in column_values(record)} == column_values(record), table
    assert (item["item_id"], item["seed"], item["measure"], item["passed"], item["request_key"],
            json.loads(item["extra_json"])) == ("i", 7, "m", True, "rk", {"e": 1})


def _v2_store(path):
    """A store as onecat wrote it at schema version 2 (column `grp` for the determinism group, `mkey`)."""
    con = duckdb.connect(str(path))
    con.execute("CREATE TABLE schema_version (version INTEGER NOT NULL, applied_at TIMESTAMP)")
    for version, sql in enumerate(MIGRATIONS[:2], start=1):
        for stmt in (s.strip() for s in sql.split(";")):
            if stmt:
                con.execute(stmt)
        con.execute("INSERT INTO schema_version VALUES (?, now())", [version])
    con.execute("INSERT INTO runs (run_id, contract_name, contract_fingerprint, contract_json, status, started_at,"
                " status_seq) VALUES ('old', 'c', 'f', '{}', 'complete', now(), 2)")
    for arm in ("baseline", "candidate"):
        for i, token_hash in enumerate(("t0", "t0", "t1")):
            con.execute("INSERT INTO requests (run_id, arm, workload, request_key, grp, token_sha256, recorded_at)"
                        " VALUES ('old', ?, 'det', ?, ?, ?, now())", [arm, f"k{i}", f"g{i // 2}", token_hash])
        con.execute("INSERT INTO metrics (run_id, arm, workload, name, mkey, value, unit, kind, recorded_at)"
                    " VALUES ('old', ?, 'tp', 'decode_tok_s', 'bs=1', 5.0, 'tok/s', 'measured', now())", [arm])
    con.close()


def _assert_reads_back(store: Store):
    requests = store.requests("old", "baseline")
    assert [(r["request_key"], r["determinism_group"]) for r in requests] == [("k0", "g0"), ("k1", "g0"),
                                                                           ("k2", "g1")]
    assert [(m["key"], m["value"]) for m in store.metrics("old", "candidate")] == [("bs=1", 5.0)]
    assert store.run("old")["kind"] == "gate"
    cfg = TokenHashEqual.Config(workload="det", compare="within_arm")
    assert TokenHashEqual().evaluate(Evidence(store, "old"), cfg).status == PASS


def test_a_v2_store_with_rows_migrates_and_reads_back(tmp_path):
    db = tmp_path / "v2.duckdb"
    _v2_store(db)
    with open_for_reading(db) as copy:  # read-only: a migrated copy is read, the file is left as it is
        assert copy.schema_version() == len(MIGRATIONS) and "older schema" in copy.describe()
        _assert_reads_back(copy)
    with duckdb.connect(str(db), read_only=True) as con:
        assert con.execute("SELECT max(version) FROM schema_version").fetchone()[0] == 2
    with Store(db) as store:  # opened for writing: migrated in place
        assert store.schema_version() == len(MIGRATIONS)
        _assert_reads_back(store)
