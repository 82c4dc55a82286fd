"""EngineArgs is the one declaration of engine settings: `LLM`, `onecat serve` and the contract schema accept
exactly its names, refuse unknown ones, and refuse settings the engine does not implement with its message."""
import re
from pathlib import Path

import pytest
import typer
import yaml
from typer.testing import CliRunner

from onecat.engine.args import EngineArgs
from onecat.engine.errors import ConfigError
from onecat.gates.contract import ENGINE_ARGS_IN_CONTRACT, ENGINE_OPTIONS, ContractError, parse_contract

ROOT = Path(__file__).resolve().parent.parent
EMBEDDED = "embedded:smollm2-135m-instruct"
CONTRACT = """\
name: t
model: {source: "embedded:smollm2-135m-instruct"}
engine: {device: cpu}
workloads:
  - {kind: ppl, dataset: wikitext2, segments: 2, segment_len: 64}
gates:
  - {check: ppl_delta, workload: ppl, max_relative: 0.01}
"""
# a valid value of every setting whose default is None (the others use their default)
SAMPLE = {"revision": "main", "quantization": "gguf", "max_model_len": 64, "kv_cache_memory_gb": 0.5, "cpu_threads": 1,
          "num_kv_blocks": 8, "speculative_config": {"method": "ngram", "num_speculative_tokens": 2}}
NOT_IMPLEMENTED = [("pipeline_parallel_size", 2), ("mamba_cache_mode", "all"),
                   ("cuda_graph", "piecewise")]


def sample(name):
    default = EngineArgs.model_fields[name].default
    return SAMPLE[name] if default is None else default


def serve_flags() -> set[str]:
    from onecat.cli.serve import app

    command = typer.main.get_command(app)
    return {p.name for p in command.params}


def contract(engine_extra: str = "", **top) -> object:
    data = yaml.safe_load(CONTRACT)
    data["engine"].update(yaml.safe_load("{" + engine_extra + "}") or {})
    data.update(top)
    return parse_contract(data)


class LoadReached(Exception):
    """Settings passed validation and the engine went on to find the model."""


@pytest.fixture
def llm_stops_at_model(monkeypatch):
    import onecat.engine.worker.worker as worker_module
    from onecat.engine.llm import LLM

    def stop(*args, **kwargs):
        raise LoadReached()

    monkeypatch.setattr(worker_module, "resolve_model_source", stop)
    return LLM


# --------------------------------------------------------------------------- one list of names
def test_serve_flags_are_engine_args_plus_server_settings():
    from onecat.engine.server.serve_config import ServeConfig

    server = set(ServeConfig.model_fields) - {"engine"}
    assert serve_flags() - server - {"uvicorn_log_level"} == set(EngineArgs.model_fields)


def test_every_setting_has_one_place_in_a_contract():
    from onecat.gates.contract import Contract, EngineSpec, ModelSpec, SpeculativeSpec

    assert set(ENGINE_ARGS_IN_CONTRACT) == set(EngineArgs.model_fields)
    sections = {"model": ModelSpec, "engine": EngineSpec}
    for name, where in ENGINE_ARGS_IN_CONTRACT.items():
        section, _, key = where.partition(".")
        ours = EngineArgs.model_fields[name]
        if section in sections and "." not in key:
            theirs = sections[section].model_fields[key]
            assert (theirs.annotation, theirs.default, theirs.metadata) == (ours.annotation, ours.default,
                                                                           ours.metadata), name
        elif key.startswith("options."):
            assert key.removeprefix("options.") == name and name not in EngineSpec.model_fields
        else:
            assert section in Contract.model_fields, where
    assert SpeculativeSpec is EngineArgs.model_fields["speculative_config"].annotation.__args__[0]


def test_llm_accepts_every_setting_and_refuses_unknown_ones(llm_stops_at_model):
    LLM = llm_stops_at_model
    for name in EngineArgs.model_fields:
        if name != "model":
            with pytest.raises(LoadReached):
                LLM("some-model", **{name: sample(name)})
    with pytest.raises(ConfigError, match=r"unknown engine setting 'max_seqs'; known: model, revision") as exc:
        LLM("some-model", max_seqs=4)
    assert all(name in str(exc.value) for name in EngineArgs.model_fields)
    with pytest.raises(ConfigError, match="kv_cache_dtype='int3'"):
        LLM("some-model", kv_cache_dtype="int3")


def test_cuda_graph_takes_the_old_switch_too():
    assert EngineArgs(model="m", cuda_graph=True).cuda_graph == "full"
    assert EngineArgs(model="m", cuda_graph=False).cuda_graph == "off"


# --------------------------------------------------------------------------- not implemented: one place
@pytest.mark.parametrize("name,value", NOT_IMPLEMENTED)
def test_unimplemented_settings_are_refused_with_one_message(name, value, llm_stops_at_model):
    from onecat.cli.serve import app
    from onecat.gates.engines.onecat_engine import OnecatEngine

    [message] = EngineArgs(model=EMBEDDED, **{name: value}).unsupported()
    assert "not implemented" in message and "use " in message
    with pytest.raises(ConfigError) as exc:
        llm_stops_at_model(EMBEDDED, **{name: value})
    assert str(exc.value) == message
    c = contract(f"{name}: {value}")  # legal in a contract: peers such as vLLM run it
    assert message in OnecatEngine.check(c.arm("baseline"))
    result = CliRunner().invoke(app, [EMBEDDED, "--" + name.replace("_", "-"), str(value)])
    assert result.exit_code == 2 and message in " ".join(result.output.split())


def test_shipped_tp4_nvfp4_contract_loads_with_nothing_refused():
    from onecat.gates.contract import contract_warnings, load_contract

    c = load_contract(ROOT / "contracts" / "dflash2_16k.yaml")
    assert c.engine.tensor_parallel_size == 4
    assert contract_warnings(c) == []  # NVFP4 weights are sharded over the ranks (engine/quant/packed_shard.py)


# --------------------------------------------------------------------------- contract options
def test_engine_options_are_engine_args_for_backend_onecat():
    c = contract("options: {block_size: 32, num_kv_blocks: 64}")
    args = c.arm("candidate").engine_args(seed=3)
    assert (args.block_size, args.num_kv_blocks, args.seed, args.device) == (32, 64, 3, "cpu")
    with pytest.raises(ContractError, match=r"unknown engine option 'blocksize'; the onecat backend's options are "
                                            + ", ".join(ENGINE_OPTIONS)):
        contract("options: {blocksize: 32}")
    with pytest.raises(ContractError, match=r"'max_num_seqs' is not an option: it lives at engine.max_num_seqs"):
        contract("options: {max_num_seqs: 8}")
    with pytest.raises(ContractError, match=r"engine setting block_size=3: 3 is not a power of two"):
        contract("options: {block_size: 3}")
    assert contract("backend: openai, options: {api_key_env: K}").engine.options == {"api_key_env": "K"}


def test_speculative_methods_are_what_the_engine_implements():
    with pytest.raises(ContractError, match="speculative method 'eagle' is not supported; choose one of ngram, "
                                            "draft_model, dflash"):
        contract(speculative={"method": "eagle", "model": "x/y", "num_speculative_tokens": 2})
    with pytest.raises(ContractError, match="needs a drafter `model`"):
        contract(speculative={"method": "draft_model", "num_speculative_tokens": 2})


def test_no_ghost_backends_or_kinds():
    from onecat.gates import registry

    registry.load_plugins()
    assert "vllm" not in registry.ENGINES and "humaneval" not in registry.WORKLOAD_SCHEMAS
    with pytest.raises(ContractError, match="vLLM runs as backend vllm_serve"):
        contract("backend: vllm")


# --------------------------------------------------------------------------- reasoning reaches the template
def test_reasoning_reaches_the_chat_template(monkeypatch):
    import onecat.engine
    from onecat.gates.engines.onecat_engine import OnecatEngine

    calls = []

    class RecordingLLM:
        tokenizer = None

        def __init__(self, **kwargs):
            calls.append(("open", kwargs))

        def info(self):
            return {"vocab_size": 10}

        def chat(self, conversations, params, **template_kwargs):
            calls.append(("chat", template_kwargs))

    monkeypatch.setattr(onecat.engine, "LLM", RecordingLLM, raising=False)
    arm = contract(sampling={"temperature": 0.0, "reasoning": {"enabled": True, "effort": "high"}}).arm("baseline")
    engine = OnecatEngine.open(arm, seed=5)
    engine.chat([[{"role": "user", "content": "hi"}]], None)
    assert calls == [("open", arm.engine_args(5).as_kwargs()),
                     ("chat", {"enable_thinking": True, "reasoning_effort": "high"})]


# --------------------------------------------------------------------------- defaults declared once
def test_each_default_is_declared_once():
    """Outside engine/args.py no file that handles engine settings declares one as `name: type = default`."""
    files = ["engine/llm.py", "engine/config.py", "engine/server/app.py", "engine/server/serve_config.py",
             "cli/serve.py", "gates/contract/settings.py", "gates/contract/model.py", "gates/engines/onecat_engine.py",
             "gates/engines/openai_engine.py"]
    for f in files:
        text = (ROOT / f).read_text()
        for name in EngineArgs.model_fields:
            if name in ("model", "revision", "dtype", "seed"):  # also drafter fields and the adapters' open(seed)
                continue
            assert not re.search(rf"\b{name}[ \t]*:[ \t]*[\w\[\]|., ]+=(?!=)", text), f"{f} declares a default for {name}"
