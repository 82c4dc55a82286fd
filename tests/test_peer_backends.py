"""The managed server backends (vllm_serve, llama_cpp_serve, llama_server, onecat_serve) start, answer and stop,
with every setting of the arm on the server's command line, in its environment or in each request, or refused by
name. A stub (tests/fixtures/stub_peer.py) stands in for vLLM, llama.cpp and `onecat serve`: it parses the
harness's command line with each server's flag names and records what it got."""
import json
import os
import stat
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from onecat.engine import SamplingParams
from onecat.gates.contract import ArmSettings, EngineSpec, ModelSpec, SpeculativeSpec
from onecat.gates.engines.base import EngineUnavailableError, open_engine
from onecat.gates.registry import ENGINES, load_plugins

sys.path.insert(0, str(Path(__file__).parent))
from peer_models import gguf_file as _gguf_file, hf_dir as _hf_dir  # noqa: E402

STUB = Path(__file__).resolve().parent / "fixtures" / "stub_peer.py"
ROOT = Path(__file__).resolve().parent.parent
PORT, SEED = 8123, 3


@pytest.fixture(scope="module", autouse=True)
def _plugins():
    load_plugins()


@pytest.fixture(scope="module")
def launcher(tmp_path_factory) -> str:
    """A program that runs the stub: given as the peers' interpreter (options.python) or llama-server."""
    path = tmp_path_factory.mktemp("stub") / "stub-server"
    path.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{STUB}" "$@"\n')
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("models")
    gguf = _gguf_file(root / "tiny.gguf")
    (root / "other.gguf").symlink_to(gguf)
    return {"hf": _hf_dir(root / "hf"), "hf_other": _hf_dir(root / "hf-other"), "gguf": gguf,
            "gguf_other": str(root / "other.gguf")}


def _base(backend: str, models: dict, launcher: str, log_dir: Path) -> tuple[dict, dict]:
    """(model, engine) settings each backend takes as they are."""
    engine = {"backend": backend, "device": "cpu", "max_model_len": 256, "max_num_seqs": 4,
              "max_num_batched_tokens": 512, "options": {"log_dir": str(log_dir)}}
    model = {"source": models["hf"], "dtype": "float32"}
    if backend in ("llama_cpp_serve", "llama_server"):
        model = {"source": models["gguf"], "dtype": "auto", "quantization": "gguf"}
    if backend == "llama_cpp_serve":
        engine["max_num_seqs"] = 1
    engine["options"]["executable" if backend == "llama_server" else "python"] = launcher
    if backend in ("llama_cpp_serve", "llama_server"):
        engine["options"]["n_threads"] = 1
    return model, engine


def _arm(model: dict, engine: dict, speculative=None, reasoning=None) -> ArmSettings:
    extra = {"reasoning": reasoning} if reasoning else {}
    return ArmSettings(name="peer", model=ModelSpec(**model), engine=EngineSpec(**engine), speculative=speculative,
                       **extra)


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


# what each backend's server must find on its command line and in its environment for _base's settings
EXPECTED = {
    "vllm_serve": ({"served_model_name": "{hf}", "model": "{hf}", "seed": SEED, "dtype": "float32", "max_num_seqs": 4,
                    "max_model_len": 256, "max_num_batched_tokens": 512, "kv_cache_dtype": "auto",
                    "tensor_parallel_size": 1, "pipeline_parallel_size": 1, "enable_prefix_caching": True,
                    "generation_config": "vllm", "enforce_eager": False, "speculative_config": None},
                   {"CUDA_VISIBLE_DEVICES": "", "VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "2"}),
    "llama_cpp_serve": ({"model": "{gguf}", "model_alias": "{gguf}", "seed": SEED, "n_ctx": 256, "n_batch": 512,
                         "n_threads": 1, "n_gpu_layers": 0, "cache": True, "interrupt_requests": False},
                        {"CUDA_VISIBLE_DEVICES": ""}),
    "llama_server": ({"model": "{gguf}", "alias": "{gguf}", "seed": SEED, "parallel": 4, "cont_batching": True,
                      "ctx_size": 4 * 256, "batch_size": 512, "threads": 1, "n_gpu_layers": 0, "jinja": True,
                      "log_verbosity": 4},
                     {"CUDA_VISIBLE_DEVICES": ""}),
    "onecat_serve": ({"model": "{hf}", "seed": str(SEED), "device": "cpu", "dtype": "float32", "max_model_len": "256",
                      "max_num_seqs": "4", "max_num_batched_tokens": "512"}, {}),
}


@pytest.mark.parametrize("backend", list(EXPECTED))
def test_managed_backend_starts_answers_and_stops(backend, models, launcher, tmp_path, monkeypatch):
    record = tmp_path / "record.jsonl"
    monkeypatch.setenv("STUB_PEER_RECORD", str(record))
    eng = open_engine(_arm(*_base(backend, models, launcher, tmp_path)), SEED)
    try:
        out = eng.generate(["t1 t2 t3"], SamplingParams(temperature=0.0, max_tokens=5))[0]
        info = eng.info()
    finally:
        eng.close()
    assert out.error is None and out.finish_reason == "length" and out.text.startswith(" t"), out
    assert out.timings.first_token_s > 0
    if backend.startswith("llama"):  # no token ids from llama.cpp: its text is tokenized here
        assert out.token_ids == eng.tokenizer.encode(out.text, add_special_tokens=False) != []
    else:
        assert len(out.token_ids) == 5
    start, request = _records(record)[:2]
    assert info["server_argv"].split()[0] == launcher and info["model_sha256"]
    assert Path(info["server_log"]).read_text().startswith("$ ")
    assert not eng.process.alive and _gone(start["pid"])  # stopped, nothing left running

    settings, env = EXPECTED[backend]
    fill = {"{hf}": models["hf"], "{gguf}": models["gguf"]}
    want = {k: fill.get(v, v) if isinstance(v, str) else v for k, v in settings.items()}
    assert {k: start["settings"].get(k) for k in want} == want
    assert int(start["settings"]["port"]) == int(info["base_url"].rsplit(":", 1)[1])
    assert {k: start["env"].get(k) for k in env} == env
    body = request["body"]
    assert body["max_tokens"] == 5 and body["temperature"] == 0.0 and body["stream"] is True
    if backend.startswith("llama"):  # llama.cpp's own sampling defaults are turned off in every request
        assert (body["top_k"], body["min_p"], body["repeat_penalty"]) == (0, 0.0, 1.0)
    if backend == "llama_server":
        assert body["cache_prompt"] is True


def test_quantization_gguf_reaches_onecat_serve(models, launcher, tmp_path, monkeypatch):
    record = tmp_path / "record.jsonl"
    monkeypatch.setenv("STUB_PEER_RECORD", str(record))
    model, engine = _base("onecat_serve", models, launcher, tmp_path)
    model = {"source": models["gguf"], "quantization": "gguf"}
    engine["options"]["serve_flags"] = {"max_queue_len": 7}
    open_engine(_arm(model, engine), SEED).close()
    argv = _records(record)[0]["argv"]
    assert argv[argv.index("--quantization") + 1] == "gguf" and argv[argv.index("--max-queue-len") + 1] == "7"


# --------------------------------------------------------------------------- nothing dropped
# Every contract setting an arm can carry, and a value other than _base's. For each backend the changed value
# must change what reaches the server (command line, environment, request fields) or be refused by name.
CHANGED = {
    "model.source": None,  # another model of the same format (per backend, below)
    "model.revision": "v2",
    "model.dtype": "bfloat16",
    "model.quantization": "gguf",
    "engine.device": "cuda:1",
    "engine.tensor_parallel_size": 2,
    "engine.pipeline_parallel_size": 2,
    "engine.kv_cache_dtype": "fp8_e5m2",
    "engine.attention_backend": "TORCH_SDPA_REF",
    "engine.cuda_graph": "full",
    "engine.enable_prefix_caching": False,
    "engine.mamba_cache_mode": "all",
    "engine.max_model_len": 128,
    "engine.max_num_seqs": 8,
    "engine.max_num_batched_tokens": 1024,
    "engine.base_url": "http://127.0.0.1:9",
    "speculative": SpeculativeSpec(method="ngram", num_speculative_tokens=3),
}
CHECKED_ELSEWHERE = {"engine.backend": "the backend itself", "engine.options": "test_unknown_options_are_refused",
                     "model.sha256": "test_a_model_sha256_pin_is_checked_before_the_server_starts"}


def test_the_sweep_covers_every_contract_setting():
    every = ({f"model.{name}" for name in ModelSpec.model_fields} | {"speculative"}
             | {f"engine.{name}" for name in EngineSpec.model_fields})
    assert every == set(CHANGED) | set(CHECKED_ELSEWHERE)


def _what_reaches(cls, arm: ArmSettings) -> tuple:
    argv, env = cls.command(arm, PORT, SEED)
    return argv, env, cls.request_defaults(arm)


@pytest.mark.parametrize("backend", list(EXPECTED))
def test_every_setting_reaches_the_server_or_is_refused(backend, models, launcher, tmp_path, monkeypatch):
    monkeypatch.setattr("onecat.gates.engines.onecat_engine._cuda_count", lambda: 2)  # a machine with GPUs
    cls = ENGINES[backend]
    model, engine = _base(backend, models, launcher, tmp_path)
    base = _arm(model, engine)
    assert cls.check(base) == []
    reached = _what_reaches(cls, base)
    outcomes = {}
    for path, value in CHANGED.items():
        section, _, key = path.partition(".")
        if path == "model.source":
            value = models["gguf_other" if model["source"] == models["gguf"] else "hf_other"]
        if path == "model.quantization" and model.get("quantization") == "gguf":
            value = None
        if path == "model.dtype" and model["dtype"] == "bfloat16":
            value = "float32"
        m, e = dict(model), dict(engine)
        spec = value if section == "speculative" else None
        if section == "model":
            m[key] = value
        elif section == "engine":
            e[key] = value
        arm = _arm(m, e, speculative=spec)
        named = [p for p in cls.check(arm) if path in p]
        if named:
            assert all(backend in p for p in named), named
            outcomes[path] = "refused"
        else:
            assert _what_reaches(cls, arm) != reached, f"{backend}: {path} {value!r} reaches nothing, is not refused"
            outcomes[path] = "reaches"
    # the settings the peers cannot take are refused, not dropped
    if backend.startswith("llama"):
        for path in ("model.dtype", "model.quantization", "engine.kv_cache_dtype", "engine.attention_backend",
                     "engine.cuda_graph", "speculative"):
            assert outcomes[path] == "refused", path
    if backend == "llama_cpp_serve":
        assert outcomes["engine.max_num_seqs"] == outcomes["engine.enable_prefix_caching"] == "refused"
    if backend == "vllm_serve":
        assert outcomes["model.quantization"] == outcomes["engine.attention_backend"] == "refused"
        assert outcomes["model.dtype"] == outcomes["speculative"] == outcomes["engine.max_num_seqs"] == "reaches"
    assert outcomes["engine.base_url"] == "refused"


def test_vllm_gets_bf16_and_its_speculative_config(models, launcher, tmp_path):
    model, engine = _base("vllm_serve", models, launcher, tmp_path)
    arm = _arm({**model, "dtype": "bfloat16"}, engine,
               speculative=SpeculativeSpec(method="ngram", num_speculative_tokens=3, prompt_lookup_max=4))
    argv, _ = ENGINES["vllm_serve"].command(arm, PORT, SEED)
    assert argv[argv.index("--dtype") + 1] == "bfloat16"
    assert json.loads(argv[argv.index("--speculative-config") + 1]) == {
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}
    refused = ENGINES["vllm_serve"].check(_arm(model, engine, speculative=SpeculativeSpec(
        method="ngram", num_speculative_tokens=2, adaptive=True)))
    assert any("vllm_serve cannot take speculative.adaptive" in p for p in refused), refused


def test_refusals_name_the_setting_the_backend_and_the_fix(models, launcher, tmp_path):
    model, engine = _base("llama_cpp_serve", models, launcher, tmp_path)
    [problem] = ENGINES["llama_cpp_serve"].check(_arm(model, {**engine, "max_num_seqs": 16}))
    assert problem.startswith("llama_cpp_serve cannot take engine.max_num_seqs 16") and "llama_server" in problem
    assert problem.endswith("set engine.max_num_seqs: 1")
    [problem] = ENGINES["llama_cpp_serve"].check(_arm(model, engine, reasoning={"enabled": True}))
    assert "reasoning.enabled" in problem
    server_model, server_engine = _base("llama_server", models, launcher, tmp_path)
    with pytest.raises(EngineUnavailableError, match="llama_server needs engine.max_model_len"):
        open_engine(_arm(server_model, {**server_engine, "max_model_len": None}))
    with pytest.raises(EngineUnavailableError, match="needs a GGUF model"):
        open_engine(_arm({"source": models["hf"], "dtype": "auto", "quantization": "gguf"}, engine))


def test_unknown_options_are_refused(models, launcher, tmp_path):
    for backend in EXPECTED:
        model, engine = _base(backend, models, launcher, tmp_path)
        engine["options"]["n_thread"] = 2
        problems = ENGINES[backend].check(_arm(model, engine))
        assert any(p.startswith(f"{backend} has no engine.options n_thread") for p in problems), problems
    model, engine = _base("onecat_serve", models, launcher, tmp_path)
    engine["options"]["serve_flags"] = {"max_num_seqs": 2, "bogus": 1, "kv_cache_memory_gb": 1.0}
    problems = ENGINES["onecat_serve"].check(_arm(model, engine))
    assert any("serve_flags.max_num_seqs is a contract setting: set it at engine.max_num_seqs" in p for p in problems)
    assert any("no serve flag 'bogus'" in p for p in problems) and len(problems) == 2, problems


def test_a_model_sha256_pin_is_checked_before_the_server_starts(models, launcher, tmp_path, monkeypatch):
    record = tmp_path / "record.jsonl"
    monkeypatch.setenv("STUB_PEER_RECORD", str(record))
    model, engine = _base("vllm_serve", models, launcher, tmp_path)
    with pytest.raises(EngineUnavailableError, match="refusing to measure different weights"):
        open_engine(_arm({**model, "sha256": "0" * 64}, engine))
    assert not record.exists()


# --------------------------------------------------------------------------- a server that does not come up
def test_a_server_that_dies_at_start_is_a_clear_error(models, launcher, tmp_path, monkeypatch):
    monkeypatch.setenv("STUB_PEER_EXIT_AT_START", "3")
    with pytest.raises(EngineUnavailableError) as err:
        open_engine(_arm(*_base("vllm_serve", models, launcher, tmp_path)))
    message = str(err.value)
    assert "(vllm_serve)" in message and "exited with code 3 before it was ready" in message
    assert "exiting at start" in message  # the tail of its log


def test_a_server_that_never_gets_ready_times_out_and_is_stopped(models, launcher, tmp_path, monkeypatch):
    record = tmp_path / "record.jsonl"
    monkeypatch.setenv("STUB_PEER_RECORD", str(record))
    monkeypatch.setenv("STUB_PEER_NEVER_READY", "1")
    model, engine = _base("llama_server", models, launcher, tmp_path)
    engine["options"]["startup_timeout_s"] = 1.5
    with pytest.raises(EngineUnavailableError, match="not ready after 2 s"):
        open_engine(_arm(model, engine))
    assert _gone(_records(record)[0]["pid"])


def test_a_missing_peer_is_reported_by_check(models, tmp_path):
    model, engine = _base("vllm_serve", models, str(tmp_path / "no-python"), tmp_path)
    [problem] = ENGINES["vllm_serve"].check(_arm(model, engine))
    assert "peer not installed" in problem and "scripts/setup_peers.sh vllm" in problem


# --------------------------------------------------------------------------- bench compare, end to end
def test_bench_compare_runs_the_peers_into_the_store(models, launcher, tmp_path, monkeypatch):
    """A reduced contracts/peers_cpu.yaml, every engine started against the stub: rows in DuckDB, a report
    with its plots."""
    import yaml

    from onecat.cli.main import app
    from onecat.results.store import Store

    record = tmp_path / "record.jsonl"
    monkeypatch.setenv("STUB_PEER_RECORD", str(record))
    monkeypatch.setenv("ONECAT_SERVER_LOG_DIR", str(tmp_path / "logs"))
    spec = yaml.safe_load((ROOT / "contracts" / "peers_cpu.yaml").read_text())
    spec["model"]["source"] = models["hf"]
    for label, eng in spec["engines"].items():
        eng["options"] = {**eng.get("options", {}),
                          ("executable" if eng["backend"] == "llama_server" else "python"): launcher}
        if eng.get("model", {}).get("quantization") == "gguf":
            eng["model"]["source"] = models["gguf"]
    for w in spec["workloads"]:
        w.update(num_requests=2, concurrency=min(w["concurrency"], 2), input_len=8, output_len=4)
    path = tmp_path / "peers.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    db, out = tmp_path / "r.duckdb", tmp_path / "cmp"
    res = CliRunner().invoke(app, ["bench", "compare", str(path), "--db", str(db), "--out", str(out)])
    assert res.exit_code == 0, res.output
    summary, = [json.loads(p.read_text()) for p in out.glob("*.json")]
    with Store(db, read_only=True) as store:
        outcomes = {o["arm"]: o["status"] for o in store.arm_outcomes(summary["run_id"])}
        assert outcomes == {label: "ran" for label in spec["engines"]}
        for label in spec["engines"]:
            for w in spec["workloads"]:
                rows = store.requests(summary["run_id"], label, w["name"])
                assert len(rows) == 2 and not any(r["error"] for r in rows)
    md, = out.glob("*.md")
    assert "![" in md.read_text() and list(out.glob("*-plots/*.png"))
    starts = [(r["flavor"], r["settings"]) for r in _records(record) if r["event"] == "start"]
    assert [flavor for flavor, _ in starts] == ["onecat", "onecat", "onecat", "vllm", "vllm", "llama_cpp_python",
                                                "llama_server"]
    (_, onecat), (_, packed), (_, amx_prompts), (_, vllm), (_, vllm_bf16), (_, llama_cpp), (_, llama_server) = starts
    assert "quantization" not in onecat and packed["quantization"] == "gguf"  # the packed row runs packed
    assert "cpu_prompt_matmul" not in packed and amx_prompts["cpu_prompt_matmul"] == "bf16"  # its serve flag arrives
    assert vllm["dtype"] != "bfloat16" and vllm_bf16["dtype"] == "bfloat16"  # the bf16 row runs bf16
    assert llama_cpp["model_alias"] == models["gguf"] and llama_server["parallel"] == 16
    assert llama_server["ctx_size"] == 16 * 2048
