"""One real run of contracts/smoke.yaml on the embedded model, through the CLI, end to end."""
import importlib.util
import os
import re
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from onecat.cli.main import app
from tests.embedded_model import needs_embedded_model

ROOT = Path(__file__).resolve().parent.parent
SMOKE = ROOT / "contracts" / "smoke.yaml"

pytestmark = [
    needs_embedded_model,
    pytest.mark.skipif(importlib.util.find_spec("exllamav2") is None,
                       reason="calibration text package exllamav2 (--no-deps) not installed"),
]


def test_smoke_contract_runs_end_to_end(tmp_path):
    from onecat.results.store import Store

    db, out = tmp_path / "r.duckdb", tmp_path / "reports"
    t0 = time.perf_counter()
    result = CliRunner().invoke(app, ["gate", "run", str(SMOKE), "--db", str(db), "--out", str(out),
                                      "--no-progress"])
    wall = time.perf_counter() - t0
    assert result.exit_code in (0, 1, 3), result.output  # a verdict, not an error
    verdict = {0: "PROMOTE", 1: "ROLLBACK", 3: "INCONCLUSIVE"}[result.exit_code]
    assert verdict in result.output
    report = Path(re.search(r"report: (\S+\.md)", result.output).group(1))
    assert report.is_file() and f"**Verdict: {verdict}**" in report.read_text()
    s = Store(db, read_only=True)
    (run_id, status, fp), = s.query("SELECT run_id, status, contract_fingerprint FROM runs")[1]
    assert status == "complete"
    env = {e["arm"]: e for e in s.environment(run_id)}
    assert env["candidate"]["kv_cache_dtype"] == "fp8_e5m2" and env["baseline"]["kv_cache_dtype"] != "fp8_e5m2"
    checks = {c["check_name"]: c["status"] for c in s.checks(run_id)}
    assert set(checks) == {"ppl_delta", "natural_stop_rate", "token_hash_equal", "not_slower"}
    # quality gates the FP8 KV path must meet on this model
    assert checks["ppl_delta"] == "pass" and checks["token_hash_equal"] == "pass"
    n_req = s.query("SELECT count(*) FROM requests WHERE run_id = ? AND token_sha256 IS NOT NULL", [run_id])[1][0][0]
    assert n_req > 0
    print(f"smoke gate: {verdict} in {wall:.1f}s")
    if os.getloadavg()[0] <= (os.cpu_count() or 1) + 0.5:  # a busy machine says nothing about the budget
        assert wall < 300, f"smoke contract took {wall:.0f}s; it must stay under 5 minutes on 2 cores"
