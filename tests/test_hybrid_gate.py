"""contracts/hybrid_prefix_cpu.yaml end to end through `onecat gate run` on a tiny random-init Qwen3.5-MoE:
prefix caching with recurrent-state snapshots (mamba_cache_mode align) must PROMOTE, its tokens equal to
computing every prompt in full, with the candidate's later requests really served from the prefix cache."""
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests.tiny_moe_hybrid import make_tiny_moe_hybrid

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parent.parent
CONTRACT = ROOT / "contracts" / "hybrid_prefix_cpu.yaml"
MODEL_DIR = ".onecat/tiny/qwen3_5_moe"


def test_hybrid_prefix_contract_promotes(tmp_path):
    from onecat.cli.main import app
    from onecat.results.store import Store

    model = make_tiny_moe_hybrid("qwen3_5_moe", tmp_path / "model")
    text = CONTRACT.read_text()
    assert f'source: "{MODEL_DIR}"' in text
    contract = tmp_path / "hybrid_prefix_cpu.yaml"
    contract.write_text(text.replace(MODEL_DIR, str(model)))
    db = tmp_path / "r.duckdb"
    result = CliRunner().invoke(app, ["gate", "run", str(contract), "--db", str(db), "--out", str(tmp_path / "out"),
                                      "--no-progress"])
    assert result.exit_code == 0 and "PROMOTE" in result.output, result.output
    s = Store(db, read_only=True)
    (run_id,), = s.query("SELECT run_id FROM runs")[1]
    assert {c["gate_id"]: c["status"] for c in s.checks(run_id)} == {
        "prefix_hits_keep_tokens": "pass", "determinism": "pass"}
    cached = dict(s.query("SELECT arm, sum(num_cached_tokens) FROM requests WHERE run_id = ? GROUP BY arm",
                          [run_id])[1])
    assert cached["baseline"] == 0 and cached["candidate"] > 0
