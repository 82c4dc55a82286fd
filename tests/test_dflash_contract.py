"""The DFlash contracts (contracts/smollm2_dflash.yaml, smollm2_dflash_cuda.yaml): both validate; without
the committed drafter `gate run` stops before loading anything (exit 4, saying the drafter is not
present); and a shrunken copy of the CPU contract, its drafter swapped for a random-weight one, runs end
to end: every token and the perplexity are kept, and the acceptance gate fails on its evidence, so the
candidate is not promoted."""
import json
import os
import re
import shutil
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from onecat.cli.main import app
from onecat.gates.contract import load_contract
from tests.embedded_model import needs_embedded_model
from tests.test_speculative import write_random_dflash

ROOT = Path(__file__).resolve().parent.parent
CPU = ROOT / "contracts" / "smollm2_dflash.yaml"
CUDA = ROOT / "contracts" / "smollm2_dflash_cuda.yaml"
DRAFTER = "embedded:smollm2-135m-dflash"

# GSM8K and WikiText-2 are not packaged: they come from ../shared/data (conftest) or $ONECAT_DATA_DIR
needs_datasets = pytest.mark.skipif(not all((Path(os.environ.get("ONECAT_DATA_DIR", "/nonexistent")) / name).exists()
                                            for name in ("gsm8k", "wikitext2")),
                                    reason="GSM8K / WikiText-2 not found: set ONECAT_DATA_DIR or put ../shared/data "
                                           "beside the checkout")


def test_contract_check_accepts_both():
    result = CliRunner().invoke(app, ["contract", "check", str(CPU), str(CUDA)])
    assert result.exit_code == 0, result.output
    for path, device in ((CPU, "cpu"), (CUDA, "cuda")):
        c = load_contract(path)
        spec = c.arm("candidate").speculative
        assert (spec.method, spec.model, spec.num_speculative_tokens) == ("dflash", DRAFTER, 7)
        assert c.arm("baseline").speculative is None
        assert c.engine.device == device and c.sampling.temperature == 0.0
        assert not c.engine.enable_prefix_caching  # a cached prefix would hide target features from the drafter
        speed = {g.workload for g in c.gates if g.check == "speedup"}
        # the speed gates time held-out chat prompts, never synthetic random tokens
        assert speed and all(c.workload(w).kind == "chat_decode_throughput" for w in speed)
    assert load_contract(CUDA).engine.cuda_graph == "full"


def test_gate_run_without_the_drafter_stops_before_loading(monkeypatch, tmp_path):
    from onecat.engine import model_source

    monkeypatch.setattr(model_source, "DRAFTERS_DIR", tmp_path / "no-drafters")
    for path in (CPU, CUDA):
        db = tmp_path / f"{path.stem}.duckdb"
        result = CliRunner().invoke(app, ["gate", "run", str(path), "--db", str(db), "--no-progress"])
        assert result.exit_code == 4, result.output
        assert "nothing was loaded" in result.output and "drafter model" in result.output
        assert "smollm2-135m-dflash is not present in this install" in result.output
        assert not db.exists()


def shrunken_cpu_contract(tmp_path: Path, drafter: Path) -> Path:
    """The CPU contract with its drafter replaced and its workloads cut to a few items; settings, gates and
    thresholds stay the file's."""
    data = yaml.safe_load(CPU.read_text())
    data["arms"]["candidate"]["speculative"]["model"] = str(drafter)
    sizes = {"chat_decode_throughput": {"subset": {"first": 1}, "output_len": 8, "warmup": 0},
             "gsm8k": {"subset": {"first": 2}, "max_tokens": 24},
             "ppl": {"segments": 2, "segment_len": 32}}
    for w in data["workloads"]:
        w.update(sizes[w["kind"]])
    for g in data["gates"]:
        if g["check"] == "natural_stop_rate":
            g["min_samples"] = 2
    path = tmp_path / "smollm2_dflash_small.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@needs_embedded_model
@needs_datasets
def test_cpu_contract_with_a_random_drafter_is_not_promoted(tmp_path):
    from onecat.results.store import Store

    drafter = write_random_dflash(tmp_path / "drafter", 576, 0, [1, 15, 28], block_size=8)
    # the contract drafts over the shipped drafter's ranked vocabulary: the same target, so the same ids serve
    shutil.copy(ROOT / "engine" / "drafters" / "smollm2-135m-dflash" / "draft_vocab.json", drafter)
    db = tmp_path / "r.duckdb"
    result = CliRunner().invoke(app, ["gate", "run", str(shrunken_cpu_contract(tmp_path, drafter)), "--db", str(db),
                                      "--out", str(tmp_path / "reports"), "--no-progress"])
    assert result.exit_code in (1, 3), result.output  # ROLLBACK or INCONCLUSIVE, never PROMOTE or an error
    report = Path(re.search(r"report: (\S+\.md)", result.output).group(1))
    assert "**Verdict: PROMOTE**" not in report.read_text()
    s = Store(db, read_only=True)
    (run_id,), = s.query("SELECT run_id FROM runs")[1]
    checks = {c["gate_id"]: c for c in s.checks(run_id)}
    acceptance = checks["acceptance_min:gsm8k"]
    stat = json.loads(acceptance["statistic_json"])
    # evaluated (enough drafts), and failed because a random drafter moves about one token per round
    assert acceptance["status"] == "fail", acceptance["summary"]
    assert stat["drafts"] >= 20 and stat["acceptance_length"] < 2.0 and stat["ci_high"] < stat["min_length"] == 3.0
    assert len(stat["accepted_per_position"]) == 7  # block 8: seven draft positions counted
    # speculation kept every token and the perplexity, whatever the drafter proposed
    assert checks["token_hash_equal"]["status"] == "pass", checks["token_hash_equal"]["summary"]
    assert checks["ppl_delta:ppl"]["status"] == "pass", checks["ppl_delta:ppl"]["summary"]
    drafted = s.query("SELECT sum(spec_num_drafts) FROM requests WHERE run_id = ? AND arm = 'candidate' "
                      "AND workload = 'decode_chat'", [run_id])[1][0][0]
    assert drafted > 0  # the speed workload's chat prompts went through the drafter
    assert {"decode_tok_s", "spec_decode_tok_s"} <= {r[0] for r in s.query(
        "SELECT DISTINCT name FROM metrics WHERE run_id = ? AND workload = 'decode_chat'", [run_id])[1]}
