"""Arms at code revisions, on a fixture git repository: a clone of this checkout's HEAD with commits made
here (model numerics scaled, a sleep in every engine step, an engine that fails to import). The harness
(runners, checks, store) is this checkout's; each arm's engine is imported by a worker from its revision."""
import importlib.util
import subprocess
from pathlib import Path

import pytest
from typer.testing import CliRunner

from onecat.cli.main import app
from onecat.gates.contract import CodeRevision, ContractError, parse_contract, pin_code
from onecat.gates.gate_run import run_gate
from onecat.gates.revision.repository import dirty_sha256
from onecat.gates.revision.resolve import working_tree_code
from onecat.results.store import Store
from tests.embedded_model import needs_embedded_model

ROOT = Path(__file__).resolve().parent.parent
MODEL_RUN = [  # each runs the embedded model in two workers: 30-50 s on 2 cores, about 2 minutes together
    needs_embedded_model,
    pytest.mark.skipif(importlib.util.find_spec("exllamav2") is None, reason="calibration text package exllamav2 "
                       "(--no-deps) not installed"),
]


def model_run(test):
    for mark in MODEL_RUN:
        test = mark(test)
    return test

CONTRACT = """\
name: revision-arms
model: {source: "embedded:smollm2-135m-instruct", dtype: float32}
engine: {backend: onecat, device: cpu, max_model_len: 256, max_num_seqs: 2}
sampling: {temperature: 0.0, max_tokens: 8}
workloads:
  - {kind: decode_throughput, input_len: 16, output_len: 8, batch_sizes: [1], repeats: 3, warmup: 1}
  - {kind: ppl, dataset: calibration_wiki, segments: 3, segment_len: 64}
gates:
  - {check: ppl_delta, workload: ppl, max_relative: 0.01}
  - {check: token_hash_equal, workload: decode_throughput}
  - {check: not_slower, workload: decode_throughput, metric: decode_tok_s, tolerance: 0.6, min_observations: 3}
"""
SMALL = {"name": "x", "model": {"source": "embedded:smollm2-135m-instruct"},
         "workloads": [{"kind": "ppl", "dataset": "calibration_wiki", "segments": 2, "segment_len": 64}],
         "gates": [{"check": "ppl_delta", "max_relative": 0.01}]}


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True, text=True).stdout.strip()


def commit_change(repo: Path, branch: str, path: str, old: str, new: str) -> None:
    git(repo, "checkout", "-q", "-b", branch, "main")
    f = repo / path
    text = f.read_text()
    assert text.count(old) == 1, f"{path} no longer holds {old!r}: update the fixture"
    f.write_text(text.replace(old, new))
    git(repo, "commit", "-q", "-am", f"fixture: {branch}")
    git(repo, "checkout", "-q", "main")


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    """A clone of this checkout's HEAD on branch main, with one branch per candidate change."""
    r = tmp_path_factory.mktemp("fixture") / "repo"
    subprocess.run(["git", "clone", "-q", "--no-hardlinks", str(ROOT), str(r)], check=True)
    git(r, "checkout", "-q", "-B", "main")
    git(r, "config", "user.email", "fixture@example.com")
    git(r, "config", "user.name", "fixture")
    commit_change(r, "numerics", "engine/layers/norm.py", "self.eps = eps", "self.eps = eps * 1e4")
    commit_change(r, "slow", "engine/core/engine_core.py",
                  '"""Advance every scheduled request by one step; returns the ids of the requests it touched."""',
                  '"""Advance every scheduled request by one step; returns the ids of the requests it touched."""\n'
                  "        time.sleep(0.5)")
    commit_change(r, "broken", "engine/__init__.py", '"""onecat inference engine', 'raise ImportError("fixture")\n"""')
    (r / "contract.yaml").write_text(CONTRACT)
    return r


@pytest.fixture
def in_repo(repo, monkeypatch):
    monkeypatch.chdir(repo)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # two workers on a small shared CPU: no spinning thread pools
    return repo


def gate(repo: Path, tmp_path: Path, **refs):
    out = run_gate(repo / "contract.yaml", tmp_path / "r.duckdb", report_dir=tmp_path / "reports", code_refs=refs)
    return out, {g.id.split(":")[0]: r.status for g, r in out.results}


# --------------------------------------------------------------------------- no model needed
def test_unpinned_contract_keeps_its_fingerprint():
    c = parse_contract(SMALL)
    assert "code" not in c.canonical_json() and c.arm("baseline").code is None
    assert pin_code(c, {"baseline": None, "candidate": None}) is c
    pinned = pin_code(c, {"baseline": "main"})
    assert pinned.arms.baseline.code.ref == "main" and pinned.fingerprint != c.fingerprint


def test_arm_fingerprint_names_the_commit_not_the_ref():
    arm = parse_contract(SMALL).arm("baseline")
    a = arm.model_copy(update={"code": CodeRevision(commit="a" * 40, ref="main", source="/x", label="l")})
    b = arm.model_copy(update={"code": CodeRevision(commit="a" * 40, ref="HEAD~0", source="/y", label="m")})
    c = arm.model_copy(update={"code": CodeRevision(commit="b" * 40, ref="main", source="/x", label="l")})
    assert a.fingerprint == b.fingerprint != c.fingerprint != arm.fingerprint


@pytest.mark.parametrize("ref", ["", "-n", "--upload-pack=x", "a b"])
def test_refs_that_are_no_revision_names_are_refused(ref):
    with pytest.raises(ContractError, match="not a git revision name"):
        pin_code(parse_contract(SMALL), {"candidate": ref})


def test_pinned_code_needs_the_onecat_backend_on_both_arms():
    data = {**SMALL, "engine": {"backend": "openai", "base_url": "http://127.0.0.1:1"}}
    with pytest.raises(ContractError, match="cannot run pinned engine code"):
        pin_code(parse_contract(data), {"baseline": "main"})
    with pytest.raises(ContractError, match="cannot run pinned engine code"):
        parse_contract({**data, "arms": {"baseline": {"code": {"ref": "main"}}}})


def test_working_tree_fingerprint_follows_uncommitted_engine_changes(repo, tmp_path):
    work = tmp_path / "work"
    subprocess.run(["git", "clone", "-q", str(repo), str(work)], check=True)
    clean = working_tree_code(work)
    assert clean.dirty_sha256 is None and clean.commit == git(work, "rev-parse", "HEAD")
    (work / "engine" / "new_module.py").write_text("X = 1\n")
    untracked = dirty_sha256(work)
    (work / "engine" / "layers" / "norm.py").write_text("# edited\n")
    edited = dirty_sha256(work)
    (work / "docs" / "note.md").write_text("not engine code\n")
    assert None is not untracked != edited == dirty_sha256(work)


def test_a_ref_that_names_no_commit_is_exit_4_with_nothing_stored(in_repo, tmp_path):
    db = tmp_path / "r.duckdb"
    result = CliRunner().invoke(app, ["gate", "run", "contract.yaml", "--db", str(db), "--no-progress",
                                      "--baseline-ref", "no-such-branch"])
    assert result.exit_code == 4, result.output
    assert "'no-such-branch' is not a commit" in result.output
    assert not db.exists() or Store(db, read_only=True).query("SELECT count(*) FROM runs")[1][0][0] == 0


# --------------------------------------------------------------------------- real runs on the embedded model
@model_run
def test_changed_numerics_roll_back(in_repo, tmp_path):
    out, status = gate(in_repo, tmp_path, baseline="main", candidate="numerics")
    assert out.verdict.decision == "ROLLBACK"
    assert status["ppl_delta"] == "fail" and status["token_hash_equal"] == "fail"
    s = Store(tmp_path / "r.duckdb", read_only=True)
    env = {e["arm"]: e for e in s.environment(out.run_id)}
    assert '"code_commit": "' + git(in_repo, "rev-parse", "numerics") in env["candidate"]["engine_info_json"]
    assert "candidate engine code" in out.report_path.read_text()


@pytest.mark.slow  # ~30 s of timed runs; the speed checks themselves are tested on synthetic rows (test_checks)
@model_run
def test_a_sleep_in_every_step_rolls_back_on_speed(in_repo, tmp_path):
    out, status = gate(in_repo, tmp_path, baseline="main", candidate="slow")
    assert out.verdict.decision == "ROLLBACK"
    assert status["not_slower"] == "fail" and status["ppl_delta"] == "pass" and status["token_hash_equal"] == "pass"


@pytest.mark.slow  # the default run keeps test_changed_numerics_roll_back (a full two-arm gate as well)
@model_run
def test_the_same_code_on_both_sides_never_rolls_back(in_repo, tmp_path):
    out, status = gate(in_repo, tmp_path, baseline="main")  # candidate: the (clean) working tree at main
    assert out.verdict.decision in ("PROMOTE", "INCONCLUSIVE")
    assert status["ppl_delta"] == "pass" and status["token_hash_equal"] == "pass"
    run = Store(tmp_path / "r.duckdb", read_only=True).run(out.run_id)
    assert run["baseline_fingerprint"] == run["candidate_fingerprint"]


@model_run
def test_an_engine_that_fails_to_import_is_exit_4_and_the_run_is_not_complete(in_repo, tmp_path):
    db = tmp_path / "r.duckdb"
    result = CliRunner().invoke(app, ["gate", "run", "contract.yaml", "--db", str(db), "--no-progress",
                                      "--baseline-ref", "broken"])
    assert result.exit_code == 4, result.output
    assert "importing its engine failed in the worker" in result.output and "fixture" in result.output
    statuses = [r[0] for r in Store(db, read_only=True).query("SELECT status FROM runs")[1]]
    assert statuses == ["failed"]
