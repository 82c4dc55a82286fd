"""The seed's routes as contracts (contracts/seed_route_h200.yaml, seed_moe_route_h200.yaml): both validate
with the routes' settings; a CPU-sized copy runs end to end through `gate run` (random weights of a tiny
shape of the same layer kinds, synthetic speculation learning the target's greedy continuation in the
warm-up): tokens identical to target-only and the set acceptance reached. `random:` shapes and method
synthetic refuse what they cannot do."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError
from typer.testing import CliRunner

from onecat.cli.main import app
from onecat.engine import LLM, SamplingParams
from onecat.engine.args import SpeculativeConfig
from onecat.engine.errors import ModelNotFoundError
from onecat.engine.model_source import resolve_model_source
from onecat.gates.contract import load_contract
from onecat.results.store import Store

ROOT = Path(__file__).resolve().parent.parent
ROUTES = {"seed_route_h200.yaml": ("random:qwen3.5-27b", "dflash", 4.27),
          "seed_moe_route_h200.yaml": ("random:qwen3.5-35b-a3b", "mtp", 2.5)}


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ONECAT_CACHE_DIR", str(tmp_path / "cache"))


@pytest.mark.parametrize("name", sorted(ROUTES))
def test_route_contracts_state_the_routes_settings(name):
    path = ROOT / "contracts" / name
    assert CliRunner().invoke(app, ["contract", "check", str(path)]).exit_code == 0
    c = load_contract(path)
    source, compute, acceptance = ROUTES[name]
    assert c.model.source == source and c.model.quantization is not None
    assert (c.engine.kv_cache_dtype, c.engine.cuda_graph, c.engine.mamba_cache_mode) == ("fp8_e5m2", "full", "align")
    assert c.engine.enable_prefix_caching and c.engine.tensor_parallel_size == 1
    assert c.engine.options["load_format"] == "dummy_peaked"
    spec = c.arm("candidate").speculative
    assert (spec.method, spec.compute, spec.acceptance_length) == ("synthetic", compute, acceptance)
    assert {g.check for g in c.gates} >= {"token_hash_equal", "acceptance_min", "speedup"}


@pytest.mark.parametrize("name, shape", [("seed_route_h200.yaml", "tiny-qwen3.5"),
                                         ("seed_moe_route_h200.yaml", "tiny-qwen3.5-moe")])
def test_a_cpu_sized_route_runs_through_the_gate(tmp_path, name, shape):
    """The route's settings on a tiny shape of the same layer kinds, on CPU: the packed format the CPU runs
    (w4a16, quantized at load like the route's NVFP4), FP8 E5M2 KV, prefix align, the route's synthetic
    compute (DFlash-shaped drafter / the MTP head)."""
    data = yaml.safe_load((ROOT / "contracts" / name).read_text())
    data["model"] = {"source": f"random:{shape}", "dtype": "float32", "quantization": "w4a16"}
    data["engine"]["device"] = "cpu"
    spec = data["arms"]["candidate"]["speculative"]
    spec["acceptance_length"] = min(spec["acceptance_length"], 4.0)
    data["workloads"][0].update(input_len=48, output_len=40, batch_sizes=[1, 2], repeats=2)
    data["gates"] = [g for g in data["gates"] if g["check"] != "speedup"]  # tiny shapes time nothing real
    for g in data["gates"]:
        if g["check"] == "acceptance_min":
            g["min_length"] = spec["acceptance_length"] - 0.2  # the last round of a request is cut by max_tokens
    path = tmp_path / "route.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    db = tmp_path / "r.duckdb"
    result = CliRunner().invoke(app, ["gate", "run", str(path), "--db", str(db), "--out", str(tmp_path / "reports"),
                                      "--no-progress"])
    assert result.exit_code == 0, result.output  # PROMOTE: both gates pass
    s = Store(db, read_only=True)
    (run_id,), = s.query("SELECT run_id FROM runs")[1]
    checks = {c["gate_id"]: c["status"] for c in s.checks(run_id)}
    assert checks == {"token_hash_equal:decode_throughput": "pass", "acceptance_min:decode_throughput": "pass"}
    drafted = s.query("SELECT sum(spec_num_drafts) FROM requests WHERE run_id = ? AND arm = 'candidate'",
                      [run_id])[1][0][0]
    assert drafted > 0


def test_random_shapes_are_the_published_ones_and_need_dummy_weights():
    cfg = json.loads((resolve_model_source("random:qwen3.5-27b", weights_required=False).path / "config.json")
                     .read_text())
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]) == (5120, 64, 248320)
    assert cfg["layer_types"].count("full_attention") == 16 and cfg["layer_types"][3] == "full_attention"
    moe = json.loads((resolve_model_source("random:qwen3.5-35b-a3b", weights_required=False).path / "config.json")
                     .read_text())
    assert (moe["num_experts"], moe["num_experts_per_tok"], moe["moe_intermediate_size"]) == (256, 8, 512)
    with pytest.raises(ModelNotFoundError, match="set load_format dummy"):
        resolve_model_source("random:qwen3.5-27b")
    with pytest.raises(ModelNotFoundError, match="unknown random shape"):
        resolve_model_source("random:qwen9", weights_required=False)


@pytest.mark.parametrize("spec, message", [
    ({"method": "synthetic", "num_speculative_tokens": 4}, "needs acceptance_length"),
    ({"method": "synthetic", "num_speculative_tokens": 4, "acceptance_length": 6.0}, "above num_speculative_tokens"),
    ({"method": "synthetic", "num_speculative_tokens": 4, "acceptance_length": 2.0, "model": "x"}, "remove model"),
    ({"method": "ngram", "num_speculative_tokens": 4, "acceptance_length": 2.0}, "only method synthetic"),
])
def test_bad_synthetic_settings_are_refused(spec, message):
    with pytest.raises(ValidationError, match=message):
        SpeculativeConfig(**spec)


@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=1.0, top_p=0.95, top_k=20, seed=7)],
                         ids=["greedy", "seed-route-sampled"])
def test_synthetic_learns_each_prompt_then_accepts_as_set(sampling):
    """Greedy, or sampled at the seed route's settings with a seed (keyed draws: the request samples the same
    tokens again, so its learned continuation sets the acceptance as well)."""
    spec = {"method": "synthetic", "num_speculative_tokens": 4, "acceptance_length": 2.5,
            "disable_when_slower": False}
    params = SamplingParams(**sampling, max_tokens=41, ignore_eos=True)
    prompts = ["t5 t6 t7 t8", "t9 t10 t11"]
    with LLM("random:tiny-llama", load_format="dummy", max_model_len=128) as plain:
        want = [o.token_ids for o in plain.generate(prompts, params)]
    with LLM("random:tiny-llama", load_format="dummy", max_model_len=128, speculative_config=spec) as llm:
        first = llm.generate(prompts, params)
        second = llm.generate(prompts, params)
        described = llm.info()["speculative"]
    assert [o.token_ids for o in first] == [o.token_ids for o in second] == want
    assert all(o.spec.num_drafts == 0 for o in first)  # nothing known yet: plain decoding
    rounds = sum(o.spec.num_drafts for o in second)
    assert 1 + sum(o.spec.num_accepted_tokens for o in second) / rounds == pytest.approx(2.5, abs=0.05)
    assert described["synthetic"] and described["prompts_known"] == 2


def test_synthetic_learns_nothing_from_unseeded_sampled_requests():
    """An unseeded sampled request draws a fresh seed each time: its output is no later request's continuation."""
    spec = {"method": "synthetic", "num_speculative_tokens": 4, "acceptance_length": 2.5,
            "disable_when_slower": False}
    params = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    with LLM("random:tiny-llama", load_format="dummy", max_model_len=128, speculative_config=spec) as llm:
        llm.generate(["t5 t6 t7 t8"], params)
        again = llm.generate(["t5 t6 t7 t8"], params)[0]
        assert llm.info()["speculative"]["prompts_known"] == 0 and again.spec.num_drafts == 0


def test_the_verify_projection_counts_distinct_experts_under_uniform_routing(monkeypatch):
    """seed_routes_gpu.verify_projection (a projection, labelled so): a verify step of w tokens reads the share
    1 - (1 - k/E)^w of the expert bytes where a step reads k/E; a dense model's verify reads what a step reads."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from seed_routes_gpu import verify_projection

    step = {"experts_active": 250, "experts_total": 1000, "total": 1250}  # k/E = 1/4 of 1000 expert bytes
    one = verify_projection(step, {"num_experts": 4, "num_experts_per_tok": 1}, 1, 1.0)
    assert one["verify_step_bytes"] == 1250 and one["round_steps_lower_bound"] == 1.0
    two = verify_projection(step, {"num_experts": 4, "num_experts_per_tok": 1}, 2, 2.5)
    assert two["distinct_expert_share"] == 0.4375 and two["verify_step_bytes"] == 1000 + 437
    assert two["speedup_upper_bound"] == round(2.5 / (1437 / 1250), 3) and "projected" in two["kind"]
    dense = verify_projection({"experts_active": 0, "experts_total": 0, "total": 900}, {}, 16, 4.27)
    assert dense["round_steps_lower_bound"] == 1.0 and dense["speedup_upper_bound"] == 4.27
