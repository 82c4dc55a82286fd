"""Contract schema: the shipped contracts load, fingerprints are stable, and errors name file, line, key."""
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from onecat.cli.main import app
from onecat.gates.contract import ContractError, load_contract, parse_contract

ROOT = Path(__file__).resolve().parent.parent
SMOKE = ROOT / "contracts" / "smoke.yaml"
DFLASH = ROOT / "contracts" / "dflash2_16k.yaml"

MINIMAL = """\
name: t
model: {source: "embedded:smollm2-135m-instruct"}
arms:
  candidate:
    engine: {kv_cache_dtype: fp8_e5m2}
workloads:
  - {kind: ppl, dataset: wikitext2, segments: 2, segment_len: 64}
gates:
  - {check: ppl_delta, workload: ppl, max_relative: 0.01}
"""


def write(tmp_path, text, name="c.yaml"):
    p = tmp_path / name
    p.write_text(text, encoding="utf-8")
    return p


def issues_of(tmp_path, text):
    with pytest.raises(ContractError) as exc:
        load_contract(write(tmp_path, text))
    return exc.value.issues, str(exc.value)


def test_shipped_contracts_validate():
    smoke = load_contract(SMOKE)
    assert smoke.arm("baseline").engine.kv_cache_dtype == "auto"
    assert smoke.arm("candidate").engine.kv_cache_dtype == "fp8_e5m2"
    dflash = load_contract(DFLASH)
    cand, base = dflash.arm("candidate"), dflash.arm("baseline")
    assert base.speculative is None
    assert cand.speculative.model == "incoai/Qwen3.8-27B-DFlash2"
    assert cand.speculative.revision == "dedf8df68adfb1afeaf7b7480c0a0243108177b4"
    assert cand.engine.tensor_parallel_size == 4 and cand.engine.kv_cache_dtype == "fp8_e5m2"
    assert cand.engine.attention_backend == "FLASH_ATTN_V100" and cand.engine.cuda_graph == "full"
    assert cand.engine.mamba_cache_mode == "align"
    assert dflash.sampling.max_tokens == 16384 and dflash.sampling.reasoning.effort == "xhigh"
    assert (dflash.sampling.temperature, dflash.sampling.top_p, dflash.sampling.top_k) == (1.0, 0.95, 20)
    assert dflash.seeds == [0, 1, 2]
    assert {w.kind for w in dflash.workloads} == {"mbpp_plus", "humaneval_plus", "ppl"}


def test_fingerprints_are_stable_and_sensitive(tmp_path):
    a = load_contract(write(tmp_path, MINIMAL, "a.yaml"))
    # same content, different key order and flow style -> same fingerprint
    data = yaml.safe_load(MINIMAL)
    b = parse_contract(dict(reversed(list(data.items()))))
    assert a.fingerprint == b.fingerprint and len(a.fingerprint) == 64
    c = load_contract(write(tmp_path, MINIMAL.replace("segments: 2", "segments: 3"), "c.yaml"))
    assert c.fingerprint != a.fingerprint
    assert a.arm("baseline").fingerprint != a.arm("candidate").fingerprint
    # workload changes do not touch the arms' engine fingerprints
    assert c.arm("candidate").fingerprint == a.arm("candidate").fingerprint


def test_unknown_nested_key_names_path_line_and_allowed_keys(tmp_path):
    text = MINIMAL.replace("engine: {kv_cache_dtype: fp8_e5m2}", "engine: {kv_cache_dtype: fp8_e5m2, kv_dtype: x}")
    issues, msg = issues_of(tmp_path, text)
    assert [(i.path, i.line) for i in issues] == [("arms.candidate.engine.kv_dtype", 5)]
    assert "unknown key 'kv_dtype'" in msg and "kv_cache_dtype" in msg and "c.yaml:5" in msg


def test_bad_value_lists_allowed_values(tmp_path):
    issues, msg = issues_of(tmp_path, MINIMAL.replace("fp8_e5m2", "fp8"))
    assert issues[0].path == "arms.candidate.engine.kv_cache_dtype" and issues[0].line == 5
    assert "'fp8_e4m3'" in msg and "got 'fp8'" in msg


def test_override_values_obey_the_shared_bounds(tmp_path):
    issues, msg = issues_of(tmp_path, MINIMAL.replace("engine: {kv_cache_dtype: fp8_e5m2}",
                                                      "engine: {kv_cache_dtype: fp8_e5m2, max_num_seqs: 0}"))
    assert [(i.path, i.line) for i in issues] == [("arms.candidate.engine.max_num_seqs", 5)]
    assert "greater than or equal to 1" in msg


def test_workload_schema_errors_are_located(tmp_path):
    issues, msg = issues_of(tmp_path, MINIMAL.replace("segments: 2", "segmnts: 2"))
    paths = {i.path for i in issues}
    assert "workloads[0].segmnts" in paths and "workloads[0].segments" in paths
    assert all(i.line == 7 for i in issues)


def test_unknown_kind_check_dataset_and_dangling_gate(tmp_path):
    issues, msg = issues_of(tmp_path, MINIMAL.replace("kind: ppl", "kind: pppl"))
    assert issues[0].path == "workloads[0].kind" and "decode_throughput" in msg
    issues, msg = issues_of(tmp_path, MINIMAL.replace("check: ppl_delta", "check: ppl_dleta"))
    assert issues[0].path == "gates[0].check" and "token_hash_equal" in msg
    issues, msg = issues_of(tmp_path, MINIMAL.replace("dataset: wikitext2", "dataset: wikitext3"))
    assert issues[0].path == "workloads[0].dataset" and "wikitext2" in msg
    issues, msg = issues_of(tmp_path, MINIMAL.replace("workload: ppl,", "workload: perplexity,"))
    assert issues[0].path == "gates[0].workload" and "perplexity" in msg


def test_near_tie_needs_greedy_top2_logprobs_of_its_workload(tmp_path):
    text = (MINIMAL.replace("  - {kind: ppl, dataset: wikitext2, segments: 2, segment_len: 64}",
                            "  - {kind: determinism, num_prompts: 2, top_logprobs: 1}")
            .replace("{check: ppl_delta, workload: ppl, max_relative: 0.01}",
                     "{check: token_hash_equal, workload: determinism, near_tie: 0.02}"))
    issues, msg = issues_of(tmp_path, text)
    assert issues[0].path == "gates[0].near_tie" and "top_logprobs: 2" in msg
    issues, msg = issues_of(tmp_path, text.replace("top_logprobs: 1", "top_logprobs: 2").replace(
        "arms:", "sampling: {temperature: 0.7}\narms:"))
    assert issues[0].path == "gates[0].near_tie" and "temperature 0" in msg
    ok = load_contract(write(tmp_path, text.replace("top_logprobs: 1", "top_logprobs: 2")))
    assert ok.gates[0].near_tie == 0.02


def test_duplicate_keys_and_bad_yaml(tmp_path):
    issues, _ = issues_of(tmp_path, MINIMAL + "name: again\n")
    assert issues[0].path == "name" and issues[0].line == 10 and "duplicate" in issues[0].message
    issues, _ = issues_of(tmp_path, "name: [unclosed\n")
    assert "not valid YAML" in issues[0].message


def test_missing_required_and_missing_file(tmp_path):
    issues, _ = issues_of(tmp_path, MINIMAL.replace('model: {source: "embedded:smollm2-135m-instruct"}\n', ""))
    assert [i.path for i in issues] == ["model"] and issues[0].message == "required key is missing"
    with pytest.raises(ContractError, match="file not found"):
        load_contract(tmp_path / "nope.yaml")


def test_schema_only_kinds_validate_and_unknown_fields_are_refused(tmp_path):
    text = MINIMAL.replace("workloads:\n", "workloads:\n  - {kind: mbpp_plus, dataset: mbpp_plus, subset: {first: 5}}\n")
    c = load_contract(write(tmp_path, text))
    assert c.workloads[0].kind == "mbpp_plus" and c.workloads[0].subset.first == 5
    issues, _ = issues_of(tmp_path, text.replace("subset: {first: 5}", "limit: 5"))
    assert issues[0].path == "workloads[0].limit"


def test_speculative_override_and_drafter_required(tmp_path):
    text = MINIMAL.replace("engine: {kv_cache_dtype: fp8_e5m2}",
                           "speculative: {method: draft_model, num_speculative_tokens: 4}")
    issues, msg = issues_of(tmp_path, text)
    assert "drafter" in msg
    ok = load_contract(write(tmp_path, text.replace("method: draft_model", "method: ngram")))
    assert ok.arm("candidate").speculative.method == "ngram" and ok.arm("baseline").speculative is None


def test_cli_contract_check_exit_codes(tmp_path):
    runner = CliRunner()
    good = runner.invoke(app, ["contract", "check", str(SMOKE), str(DFLASH)])
    assert good.exit_code == 0, good.output
    bad = runner.invoke(app, ["contract", "check", str(write(tmp_path, MINIMAL.replace("fp8_e5m2", "fp9")))])
    assert bad.exit_code == 2


def test_dflash2_gate_run_stops_before_loading(monkeypatch, tmp_path):
    monkeypatch.setenv("ONECAT_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))
    result = CliRunner().invoke(app, ["gate", "run", str(DFLASH), "--db", str(tmp_path / "r.duckdb"),
                                      "--no-progress"])
    assert result.exit_code == 4
    out = result.output
    assert "nothing was loaded" in out and "QUASAR-QAT/Qwen3.8-27B-QUASAR-NVFP4" in out and "looked in" in out
    assert "incoai/Qwen3.8-27B-DFlash2" in out and "4 GPUs" in out
    # only what this machine lacks (checkpoints, GPUs): the route's combination of settings is not refused
    assert "support matrix" not in out and "not implemented" not in out
    assert not (tmp_path / "r.duckdb").exists()  # failed before the store was even opened


def test_kind_without_runner_validates_but_cannot_run(tmp_path):
    from onecat.gates.gate_run import PreflightError, preflight
    from onecat.gates.registry import WORKLOAD_SCHEMAS, declare_workload_schema
    from onecat.gates.runners.base import TaskWorkload

    declare_workload_schema("future_task", TaskWorkload)
    try:
        text = MINIMAL.replace("workloads:\n", "workloads:\n  - {kind: future_task}\n")
        c = load_contract(write(tmp_path, text))
        with pytest.raises(PreflightError, match="kind 'future_task' has no runner"):
            preflight(c)
    finally:
        WORKLOAD_SCHEMAS.pop("future_task")


def test_docs_list_every_limit_with_its_default_and_keys():
    from onecat.gates.contract import describe_limits

    doc = (ROOT / "docs" / "harness.md").read_text(encoding="utf-8").splitlines()
    for name, default, _, keys in describe_limits():
        row = next((line for line in doc if line.startswith(f"| `{name}` |")), None)
        assert row is not None, f"docs/harness.md has no row for limit {name}"
        assert f"{default:,}" in row and all(f"`{k}`" in row for k in keys), row


def test_python_api_refuses_what_the_yaml_reader_would(tmp_path):
    data = yaml.safe_load(MINIMAL)
    data["engine"] = {"options": {"x": float("inf")}}
    with pytest.raises(ContractError, match="not a finite number"):
        parse_contract(data)
    data = yaml.safe_load(MINIMAL)
    data["seeds"] = [2 ** 70]
    with pytest.raises(ContractError, match="does not fit in 64 bits"):
        parse_contract(data)
    data = yaml.safe_load(MINIMAL)
    data["workloads"][0]["segments"] = True
    with pytest.raises(ContractError, match="true/false is not a number"):
        parse_contract(data)
