"""`onecat bench compare` reports a dead engine as FAILED, never as a slow one: a peer killed by SIGSEGV while
loading, one killed by its first request, and one that stays up but fails every request are FAILED rows with
the cause ("killed by SIGSEGV (-11)", never cut) and their last output in the JSON, the markdown and the
store, with no figures, and the command exits 4; a healthy peer next to them is measured as usual. The record
names the machine (label, CPU, ISA flags), each engine's load at start and the instruction sets it used.
The peers are tests/fixtures/stub_peer.py, told how to fail by its environment."""
import json
import stat
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from onecat.cli.main import app
from onecat.gates.engines.isa_report import llama_cpp_isa
from onecat.gates.engines.server_process import exit_cause
from onecat.gates.registry import load_plugins
from onecat.reports.plot_data import compare_plot_data
from onecat.results import environment
from onecat.results.store import Store

sys.path.insert(0, str(Path(__file__).parent))
from peer_models import gguf_file  # noqa: E402

STUB = Path(__file__).resolve().parent / "fixtures" / "stub_peer.py"
# engine label -> (backend, the stub's environment: how it fails)
PEERS = {
    "healthy": ("llama_server", ""),
    "crashes-loading": ("llama_server", "STUB_PEER_SIGNAL_AT_START=SIGSEGV"),
    "crashes-on-request": ("llama_cpp_serve", "STUB_PEER_SIGNAL_ON_REQUEST=SIGSEGV"),
    "refuses": ("llama_server", "STUB_PEER_REFUSE_REQUESTS=drop"),
}


def _launcher(folder: Path, label: str, env: str) -> str:
    path = folder / f"stub-{label}"
    path.write_text(f'#!/bin/sh\n{env} exec "{sys.executable}" "{STUB}" "$@"\n')
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


@pytest.fixture(scope="module")
def compared(tmp_path_factory):
    load_plugins()
    root = tmp_path_factory.mktemp("compare-failures")
    gguf = gguf_file(root / "tiny.gguf")
    engines = {}
    for label, (backend, env) in PEERS.items():
        program = _launcher(root, label, env)
        engines[label] = {"backend": backend, "device": "cpu", "max_model_len": 256,
                          "max_num_seqs": 1 if backend == "llama_cpp_serve" else 2,
                          "model": {"dtype": "auto", "quantization": "gguf"},
                          "options": {"n_threads": 1, "log_dir": str(root / "logs" / label),
                                      ("python" if backend == "llama_cpp_serve" else "executable"): program}}
    spec = {"name": "dead-peers", "model": {"source": gguf}, "sampling": {"temperature": 0.0, "max_tokens": 4},
            "engines": engines,
            "workloads": [{"kind": "endpoint", "name": "w", "input_len": 8, "output_len": 4, "num_requests": 2,
                           "concurrency": 2, "warmup_requests": 1}]}
    path = root / "peers.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    db, out = root / "r.duckdb", root / "cmp"
    res = CliRunner().invoke(app, ["bench", "compare", str(path), "--db", str(db), "--out", str(out),
                                   "--machine", "test box"])
    summary, = [json.loads(p.read_text()) for p in out.glob("*.json")]
    markdown, = [p.read_text() for p in out.glob("*.md")]
    return res, summary, markdown, db


def test_a_dead_or_refusing_peer_fails_the_command(compared):
    res, summary, _, _ = compared
    assert res.exit_code == 4, res.output
    assert summary["failed"] == ["crashes-loading", "crashes-on-request", "refuses"]
    assert "FAILED: crashes-loading, crashes-on-request, refuses" in res.output


def test_a_peer_killed_while_loading_is_failed_with_its_signal_and_last_output(compared):
    _, summary, markdown, db = compared
    entry = summary["engines"]["crashes-loading"]
    assert entry["status"] == "FAILED" and "workloads" not in entry
    failure = entry["failure"]
    assert failure["cause"] == "killed by SIGSEGV (-11) before it was ready" and failure["exit_code"] == -11
    assert "ggml_amx_init: loading the tile config" in failure["output_tail"]
    assert "| crashes-loading | FAILED: killed by SIGSEGV (-11) before it was ready |" in markdown
    assert "## FAILED: crashes-loading: killed by SIGSEGV (-11)" in markdown
    assert "ggml_amx_init: loading the tile config" in markdown
    with Store(db, read_only=True) as store:
        outcome = {o["arm"]: o for o in store.arm_outcomes(summary["run_id"])}["crashes-loading"]
        assert outcome["status"] == "failed" and outcome["error"].startswith("killed by SIGSEGV (-11)")
        assert "ggml_amx_init: loading the tile config" in outcome["error"]


def test_a_peer_killed_by_its_first_request_is_failed_not_zero_tok_s(compared):
    _, summary, markdown, db = compared
    entry = summary["engines"]["crashes-on-request"]
    assert entry["status"] == "FAILED" and "workloads" not in entry
    assert entry["failure"]["cause"] == "killed by SIGSEGV (-11)" and entry["failure"]["exit_code"] == -11
    assert "ggml_compute_forward: computing the first request" in entry["failure"]["output_tail"]
    assert "| crashes-on-request | FAILED: killed by SIGSEGV (-11) |" in markdown
    assert "| crashes-on-request | 0.0" not in markdown
    with Store(db, read_only=True) as store:
        env = {e["arm"]: json.loads(e["engine_info_json"]) for e in store.environment(summary["run_id"])}
        assert env["crashes-on-request"]["failure"]["exit_code"] == -11


def test_a_peer_that_fails_every_request_is_failed(compared):
    _, summary, markdown, db = compared
    entry = summary["engines"]["refuses"]
    assert entry["status"] == "FAILED" and "workloads" not in entry
    assert entry["failure"]["cause"].startswith("every request of w failed (2 of 2); the first: ")
    assert entry["failure"]["exit_code"] is None
    assert "stub llama_server serving" in entry["failure"]["output_tail"]  # the server's log, though it is up
    assert "| refuses | FAILED: every request of w failed (2 of 2)" in markdown
    with Store(db, read_only=True) as store:
        outcome = {o["arm"]: o for o in store.arm_outcomes(summary["run_id"])}["refuses"]
        assert outcome["status"] == "failed" and "every request of w failed" in outcome["error"]


def test_a_healthy_peer_is_measured_and_failed_ones_stay_out_of_the_figures(compared):
    _, summary, markdown, _ = compared
    entry = summary["engines"]["healthy"]
    assert entry["status"] == "ran" and entry["workloads"]["w"]["num_failed"] == 0
    assert entry["workloads"]["w"]["output_tok_s"] > 0
    assert "| healthy | " in markdown and "| healthy | FAILED" not in markdown
    assert [plot.engines for plot in compare_plot_data(summary) if hasattr(plot, "engines")][0].keys() == {"healthy"}


def test_the_record_names_the_machine_the_load_and_the_isa_each_engine_used(compared):
    _, summary, markdown, db = compared
    machine = summary["machine"]
    assert machine["label"] == "test box" and machine["cpu"] and machine["cpu_threads"]
    assert set(machine["isa"]) == set(environment.ISA_FLAGS)
    assert all(isinstance(on, bool) for on in machine["isa"].values())
    for label, entry in summary["engines"].items():
        assert isinstance(entry["load_1min_at_start"], float), label
    isa = summary["engines"]["healthy"]["isa_used"]
    assert isa["source"] == "llama.cpp system_info" and "AMX_INT8" in isa["features"]
    assert isa["model_buffers"] == ["AMX", "CPU_Mapped"]
    assert "Machine: test box (CPU " in markdown and "ISA flags: " in markdown
    assert "| healthy | ran | SSE3 AVX AVX2 AVX512 AVX512_BF16 AMX_INT8 LLAMAFILE REPACK; weights in AMX" in markdown
    with Store(db, read_only=True) as store:
        env = json.loads(store.environment(summary["run_id"])[0]["engine_info_json"])
        assert env["machine"]["label"] == "test box" and "load_1min_at_start" in env


@pytest.mark.parametrize("code,words", [(-11, "killed by SIGSEGV (-11)"), (-9, "killed by SIGKILL (-9)"),
                                        (3, "exited with code 3"),
                                        (139, "exited with code 139 (128 + SIGSEGV: a shell's report")])
def test_exit_causes_keep_the_number(code, words):
    assert exit_cause(code).startswith(words)


def test_llama_cpp_system_info_is_read_from_its_log():
    log = ("main: build = 1 (0c1e570)\nsystem_info: n_threads = 2 (n_threads_batch = 2) / 2 | CPU : SSE3 = 1 | "
           "AVX = 1 | AVX_VNNI = 0 | AVX2 = 1 | AVX512 = 1 | AMX_INT8 = 1 | REPACK = 1 |\n"
           "load_tensors:   CPU_REPACK model buffer size =    54.00 MiB\n")
    isa = llama_cpp_isa(log)
    assert isa["features"] == ["SSE3", "AVX", "AVX2", "AVX512", "AMX_INT8", "REPACK"]
    assert isa["model_buffers"] == ["CPU_REPACK"] and isa["system_info"].startswith("system_info:")
    assert llama_cpp_isa("nothing about the CPU here") is None


def test_machine_flags_come_from_cpuinfo(tmp_path, monkeypatch):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Platinum 8480+\n"
                       "flags\t\t: fpu avx2 avx512f avx512_vnni avx512_bf16 amx_bf16 amx_tile amx_int8\n")
    monkeypatch.setattr(environment, "CPUINFO", str(cpuinfo))
    record = environment.machine_record()
    assert record["cpu"] == "Intel(R) Xeon(R) Platinum 8480+" and record["label"].endswith(", AMX")
    assert record["isa"] == {"amx_tile": True, "amx_bf16": True, "amx_int8": True, "avx512_bf16": True,
                             "avx512_vnni": True, "avx_vnni": False, "avx512f": True, "avx2": True}
