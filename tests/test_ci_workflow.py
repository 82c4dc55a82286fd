""".github/workflows/gate.yml, run here: its `run:` steps execute as GitHub Actions would run them, in a fixture
repository (a clone of this checkout plus one commit, the pull request), with GITHUB_* pointing at temporary
files. Only the set-up step is skipped (this checkout's .venv stands in for what it builds). Checks: the exit
code (ROLLBACK fails the job, INCONCLUSIVE only with FAIL_ON_INCONCLUSIVE=true), the job summary holds the
report, and every uploaded artifact path exists."""
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.embedded_model import needs_embedded_model

ROOT = Path(__file__).resolve().parent.parent
WORKFLOW = ROOT / ".github" / "workflows" / "gate.yml"
SETUP_COMMAND = "scripts/setup.sh"

FIXTURE = """name: ci-fixture-{verdict}
model: {{source: "embedded:smollm2-135m-instruct", dtype: float32}}
engine: {{backend: onecat, device: cpu, max_model_len: 256, max_num_seqs: 4}}
sampling: {{temperature: 0.0, max_tokens: 2}}
seeds: [0]
workloads:
  - {{kind: determinism, num_prompts: 4, reruns: 1, batch_invariance: false, max_tokens: 1}}
gates:
  - {gate}
"""
GATES = {  # one output token never stops on its own: a min_rate FAILs, too few samples is undecided
    "PROMOTE": "{check: token_hash_equal, workload: determinism, compare: arms}",
    "ROLLBACK": "{check: natural_stop_rate, workload: determinism, min_rate: 0.9, min_samples: 4}",
    "INCONCLUSIVE": "{check: natural_stop_rate, workload: determinism, min_rate: 0.0, min_samples: 1000}",
}


def _cli_has_baseline_ref() -> bool:
    out = subprocess.run([str(ROOT / ".venv" / "bin" / "onecat"), "gate", "run", "--help"], capture_output=True,
                         text=True, env={**os.environ, "COLUMNS": "200"})
    return "--baseline-ref" in out.stdout


pytestmark = [
    pytest.mark.skipif(not (ROOT / ".venv" / "bin" / "onecat").exists(), reason="no .venv/bin/onecat in this checkout"),
    needs_embedded_model,
    pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed"),
]


def _workflow() -> dict:
    data = yaml.safe_load(WORKFLOW.read_text())
    on = data.get("on", data.get(True))  # YAML 1.1 reads the key `on` as True
    assert "pull_request" in on
    return data


@pytest.fixture(scope="module")
def pr_repo(tmp_path_factory):
    """A clone of this repository's committed state with one more commit on branch `pr`: the pull request
    (it adds the fixture contracts). origin/main is the base branch, as in a checkout with full history."""
    repo = tmp_path_factory.mktemp("ci") / "repo"
    git = ["git", "-c", "user.name=ci", "-c", "user.email=ci@example.invalid"]
    subprocess.run(["git", "clone", "-q", "--no-hardlinks", str(ROOT), str(repo)], check=True)
    subprocess.run(["git", "checkout", "-q", "-b", "pr"], cwd=repo, check=True)
    for verdict, gate in GATES.items():
        (repo / "contracts" / f"ci_{verdict.lower()}.yaml").write_text(FIXTURE.format(verdict=verdict.lower(),
                                                                                       gate=gate))
    subprocess.run(["git", "add", "contracts"], cwd=repo, check=True)
    subprocess.run(git + ["commit", "-q", "-m", "fixture pull request"], cwd=repo, check=True)
    (repo / ".venv").symlink_to(ROOT / ".venv")  # what the skipped set-up step would have built
    return repo


def _run_job(repo: Path, tmp: Path, contract: str, fail_on_inconclusive: str) -> tuple[int, Path]:
    """The job's steps in order: `run:` steps in bash -eo pipefail (the Actions default) from the repository
    root; a failed step stops the job except for steps marked `if: always()`. Returns the job's exit code."""
    job = _workflow()["jobs"]["gate"]
    summary = tmp / "step_summary.md"
    env = {**os.environ, "GITHUB_BASE_REF": "main", "GITHUB_HEAD_REF": "pr", "GITHUB_STEP_SUMMARY": str(summary),
           "GITHUB_OUTPUT": str(tmp / "output"), "GITHUB_ENV": str(tmp / "env"), "GITHUB_WORKSPACE": str(repo),
           "CI": "true", "GATE_CONTRACT": contract, "FAIL_ON_INCONCLUSIVE": fail_on_inconclusive,
           "REUSE_BASELINE": "true"}
    assert set(_workflow()["env"]) <= set(env), "every workflow-level env var must be given here"
    job_code = 0
    for step in job["steps"]:
        if "run" not in step or step["run"].strip() == SETUP_COMMAND:
            continue
        if job_code and "always()" not in str(step.get("if", "")):
            continue
        done = subprocess.run(["bash", "--noprofile", "--norc", "-eo", "pipefail", "-c", step["run"]], cwd=repo,
                              env=env, capture_output=True, text=True, timeout=900)
        print(step.get("name"), done.returncode, done.stdout[-3000:], done.stderr[-3000:])
        job_code = job_code or done.returncode
    return job_code, summary


def _uploaded_paths() -> list[str]:
    upload = [s for s in _workflow()["jobs"]["gate"]["steps"] if "upload-artifact" in s.get("uses", "")]
    assert len(upload) == 1 and upload[0].get("if") == "always()"
    return [p.strip() for p in upload[0]["with"]["path"].splitlines() if p.strip()]


def test_workflow_shape():
    steps = _workflow()["jobs"]["gate"]["steps"]
    checkout = next(s for s in steps if s.get("uses", "").startswith("actions/checkout"))
    assert checkout["with"]["fetch-depth"] == 0  # the merge base needs the history
    assert any(s.get("run", "").strip() == SETUP_COMMAND for s in steps)  # the README's set-up command
    gate = "\n".join(s.get("run", "") for s in steps)
    for flag in ("--baseline-ref", "--junit gate.xml", "--out report/", "--db gate.duckdb", "GITHUB_STEP_SUMMARY"):
        assert flag in gate
    assert {"gate.duckdb", "gate.xml", "report/"} <= set(_uploaded_paths())


@pytest.mark.slow  # each case runs the embedded model in two revision workers: 1-3 minutes on 2 cores
@pytest.mark.parametrize("verdict,fail_on_inconclusive,job_code", [
    ("PROMOTE", "false", 0), ("ROLLBACK", "false", 1), ("INCONCLUSIVE", "false", 0), ("INCONCLUSIVE", "true", 3)])
def test_workflow_steps_gate_a_fixture_pull_request(pr_repo, tmp_path, verdict, fail_on_inconclusive, job_code):
    if not _cli_has_baseline_ref():
        pytest.skip("`onecat gate run --baseline-ref` is not in this build's CLI; the workflow runs it")
    repo = pr_repo
    code, summary = _run_job(repo, tmp_path, f"contracts/ci_{verdict.lower()}.yaml", fail_on_inconclusive)
    assert code == job_code
    text = summary.read_text()
    assert f"**Verdict: {verdict}**" in text and "# Gate report: ci-fixture" in text
    for path in _uploaded_paths():
        assert (repo / path).exists(), f"artifact {path} missing"
    assert list((repo / "report").glob("*.md"))
    junit = (repo / "gate.xml").read_text()
    assert f'name="verdict" value="{verdict}"' in junit
