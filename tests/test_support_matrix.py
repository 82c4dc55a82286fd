"""The support matrix (engine/support_matrix) is the engine's: its axes are the engine's settings and names, every
rule's cell is refused by `LLM(...)` with exactly the matrix's message, cells the matrix says run give the reference
tokens (greedy: the same tokens, or a near-tie where summation order or rounding differs), and
docs/support_matrix.md is the generated text. On the CPU, on the tiny checkpoints the other tests build; a cell on
cuda is checked for its refusal through the check the worker asks, and left to the GPU tests for running."""
from __future__ import annotations

import json
import subprocess
import sys
import typing
from pathlib import Path

import pytest
import torch

from onecat.engine.args import EngineArgs
from onecat.engine.errors import ConfigError
from onecat.engine.support_matrix import (ARCHITECTURES, ATTENTION_BACKENDS, CUDA_GRAPH_MODES, DEFAULTS,
                                          HYBRID_ARCHITECTURES, KV_CACHE_DTYPES, MAMBA_CACHE_MODES, QUANTIZATIONS,
                                          RULES, SPECULATIVE_METHODS, STAGES, UNKNOWN, Combination, check, example,
                                          fallbacks, first_refusals)
from onecat.engine.support_matrix.axes import GRAPH_SAFE_BACKENDS, STAGE_OF
from onecat.engine.support_matrix.markdown import COMMAND, render

ROOT = Path(__file__).resolve().parent.parent
DATA = Path(__file__).resolve().parent / "data"
PROMPTS = [[5, 17, 99, 3, 5, 17, 99, 3, 5], list(range(10, 40)), [200, 201]]
SETTINGS = ("quantization", "dtype", "load_format", "kv_cache_dtype", "attention_backend", "cuda_graph",
            "enable_prefix_caching", "mamba_cache_mode", "tensor_parallel_size", "pipeline_parallel_size",
            "cpu_prompt_matmul")
NEAR_TIE = 0.02  # nats between a run's two candidates where greedy runs may part (rounding, summation order)
PACKED_NEAR_TIE = 0.03  # the CPU int4 layer rounds activations and scales to bfloat16


# --------------------------------------------------------------------------- the matrix is the engine's
def test_the_committed_doc_is_the_generated_text():
    committed = (ROOT / "docs" / "support_matrix.md").read_text()
    assert committed == render(), f"docs/support_matrix.md is stale: run `{COMMAND}`"


def test_the_matrix_imports_nothing_heavy():
    code = "import sys, onecat.engine.support_matrix; print([m for m in ('torch', 'pydantic') if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def setting_values(name: str, inner: str | None = None) -> set:
    """The values an EngineArgs setting (or a field of its section) takes."""
    annotation = EngineArgs.model_fields[name].annotation
    if inner is not None:
        section = next(a for a in typing.get_args(annotation) if a is not type(None))
        annotation = section.model_fields[inner].annotation
    return set(typing.get_args(annotation))


def test_the_axes_are_the_engines_names():
    from onecat.engine.attention.selector import BACKEND_NAMES
    from onecat.engine.config import HF_ARCHITECTURES
    from onecat.engine.config import HYBRID_ARCHITECTURES as CONFIG_HYBRID
    from onecat.engine.models.registry import model_class
    from onecat.engine.quant.hf_packer import W4A16_NAMES
    from onecat.engine.quant.quantization import QUANTIZATIONS as ENGINE_QUANTIZATIONS

    assert set(ARCHITECTURES) == set(HF_ARCHITECTURES.values()) and HYBRID_ARCHITECTURES == CONFIG_HYBRID
    assert all(model_class(a) for a in ARCHITECTURES)
    assert set(QUANTIZATIONS) == {"gguf", *W4A16_NAMES} and ENGINE_QUANTIZATIONS is QUANTIZATIONS
    assert ATTENTION_BACKENDS == BACKEND_NAMES
    assert setting_values("kv_cache_dtype") == set(KV_CACHE_DTYPES)
    assert setting_values("mamba_cache_mode") == set(MAMBA_CACHE_MODES)
    assert setting_values("cuda_graph") == set(CUDA_GRAPH_MODES)
    assert setting_values("speculative_config", "method") == set(SPECULATIVE_METHODS)
    defaults = Combination.from_settings(EngineArgs(model="m"), checkpoint="hf", packed_cpu_kernel=None)
    assert {n: getattr(defaults, n) for n in DEFAULTS} == DEFAULTS


def test_graph_safe_backends_are_the_ones_that_say_so():
    from onecat.engine.attention.cpu_paged import CpuPagedBackend
    from onecat.engine.attention.flash_attn_v100 import FlashAttnV100Backend
    from onecat.engine.attention.torch_ref import TorchReferenceBackend
    from onecat.engine.attention.triton_paged import TritonPagedBackend

    classes = (CpuPagedBackend, FlashAttnV100Backend, TorchReferenceBackend, TritonPagedBackend)
    assert {c.name for c in classes if getattr(c, "graph_safe", False)} == set(GRAPH_SAFE_BACKENDS)


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.name)
def test_a_rule_reads_only_what_its_stage_knows_and_names_its_cell(rule):
    assert all(STAGES.index(STAGE_OF[name]) <= STAGES.index(rule.stage) for name in rule.reads)
    c = example(**rule.example)
    alone = Combination(**{name: getattr(c, name) for name in rule.reads})  # every other field UNKNOWN
    assert rule.refuses(alone) and not rule.refuses(alone.with_(**{rule.reads[-1]: UNKNOWN}))
    [mine] = [r for r in check(c) if r.rule is rule]
    assert mine.message.startswith(f"[support matrix: {rule.cell(c)}] ") and mine.cell == rule.cell(c)


# --------------------------------------------------------------------------- walking the matrix on the CPU
class Models:
    """The tiny checkpoints a cell runs on: per architecture an HF directory; a .gguf file where one exists."""

    def __init__(self, root: Path):
        from tests.test_gguf_kquants import QT, pair_of_files
        from tests.test_speculative import write_random_dflash
        from tests.tiny_models import make_tiny_model
        from tests.tiny_moe_hybrid import make_tiny_moe_hybrid

        self.hf = {a: make_tiny_model(a, root / a) for a in ("llama", "qwen2", "qwen3")}
        self.hf |= {a: make_tiny_moe_hybrid(a, root / a) for a in ("qwen3_moe", "qwen3_5", "qwen3_5_moe")}
        (root / "gguf").mkdir()
        llama_q4, self.llama_q4_dequantized = pair_of_files(root / "gguf", [QT.Q4_0, QT.Q4_1, QT.Q8_0])
        self.gguf = {"llama": llama_q4, "qwen3_5": DATA / "tiny-qwen35.gguf",
                     "qwen3_5_moe": DATA / "tiny-qwen35moe.gguf"}
        self.dflash = write_random_dflash(root / "dflash", 64, 0, [0, 1])
        self.w4a16_twin = rtn_twin(self.hf["llama"], root / "llama-rtn")

    def path(self, c: Combination) -> Path:
        return self.hf[c.architecture] if c.checkpoint == "hf" else self.gguf[c.architecture]

    def with_facts(self, c: Combination) -> Combination:
        """c with the model facts of the HF checkpoint it runs on (a dense model's are none already)."""
        if not c.hybrid or c.checkpoint != "hf":
            return c
        raw = json.loads((self.hf[c.architecture] / "config.json").read_text())
        return c.with_(linear_value_heads=raw["linear_num_value_heads"])

    def settings(self, c: Combination) -> dict:
        """The settings of `LLM(self.path(c), **settings)` that runs the combination on the CPU."""
        assert c.device == "cpu"
        kw = {name: getattr(c, name) for name in SETTINGS} | {"device": "cpu", "max_model_len": 128, "max_num_seqs": 4}
        if c.cpu_threads:
            kw["cpu_threads"] = 1
        if c.speculative is not None:
            spec = {"method": c.speculative, "num_speculative_tokens": 3}
            drafter = {"draft_model": self.path(c), "dflash": self.dflash}.get(c.speculative)
            spec |= {} if drafter is None else {"model": str(drafter)}
            spec |= {} if c.speculative_dtype == "auto" else {"dtype": c.speculative_dtype}
            kw["speculative_config"] = spec
        return kw

    def open(self, c: Combination):
        from onecat.engine import LLM

        return LLM(str(self.path(c)), **self.settings(c))


def rtn_twin(src: Path, out: Path) -> Path:
    """src with every decoder linear replaced by its round-to-nearest 4-bit weights, dequantized: what
    quantization='w4a16' computes with from a dense checkpoint (groups as engine/quant/hf_packer.py picks them)."""
    from safetensors.torch import load_file

    from onecat.engine.quant.rtn import RTN_GROUPS
    from onecat.engine.quant.w4a16.layout import dequantize, quantize_w4
    from tests.quant_checkpoints import LINEARS, dense_dir

    state = load_file(str(src / "model.safetensors"))
    linears = [n.removesuffix(".weight") for n in state if n.removesuffix(".weight").endswith(LINEARS)]
    rtn = {m: dequantize(quantize_w4(state[f"{m}.weight"], next(g for g in RTN_GROUPS
                                                               if state[f"{m}.weight"].shape[1] % g == 0)))
           for m in linears}
    return dense_dir(src, out, rtn)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    return Models(tmp_path_factory.mktemp("support_matrix"))


def refused_where_the_worker_asks(c: Combination, stage: str) -> None:
    """The device or weights check the worker makes, for a cell this machine cannot open (cuda)."""
    from onecat.engine.quant import check_quantization
    from onecat.engine.support_matrix import refuse

    if stage == "device":  # the worker's call, once the device is resolved
        refuse(c, "device")
    check_quantization(c.quantization, c.checkpoint, torch.device(c.device))


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.name)
def test_each_rule_refuses_its_cell_with_the_matrix_message(rule, models, monkeypatch):
    c = models.with_facts(example(**rule.example))
    assert all(getattr(c, name) == value for name, value in rule.example.items())  # the checkpoint's facts
    expected = first_refusals(c)
    assert rule in [r.rule for r in expected]  # the engine reports this rule for its cell
    with pytest.raises(ConfigError) as exc:
        if c.device != "cpu":
            assert rule.stage in ("device", "weights"), "a cuda cell of another stage needs its own check here"
            refused_where_the_worker_asks(c, rule.stage)
        else:
            if c.packed_cpu_kernel is False:  # a torch without the CPU int4 matmul
                from onecat.engine.quant.int4.linear import Int4PackedLinear

                monkeypatch.setattr(Int4PackedLinear, "supported", staticmethod(lambda device: False))
            models.open(c)
    assert str(exc.value) == "; ".join(r.message for r in expected)


def generate(llm):
    from onecat.engine import SamplingParams

    with llm:
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=5))
        return outs, llm.info()


def same_tokens_or_near_tie(reference, outputs, near_tie: float, what) -> None:
    """Each greedy continuation equals the reference's, or parts from it at a step where each run had the other's
    token within `near_tie` nats of its own pick (and is not compared after that)."""
    for ref, out in zip(reference, outputs):
        for step, (a, b) in enumerate(zip(ref.token_ids, out.token_ids)):
            if a != b:
                for run, mine, other in ((ref, a, b), (out, b, a)):
                    top = run.logprobs[step]
                    assert other in top and top[mine] - top[other] <= near_tie, (what, step, a, b, top)
                break


# (changes from the defaults, how the cell's tokens compare with the reference run's: same | near)
EVERY_ARCHITECTURE = [({"speculative": "ngram"}, "same"), ({"cuda_graph": "full"}, "same"),
                      ({"attention_backend": "TORCH_SDPA_REF"}, "near"), ({"kv_cache_dtype": "fp8_e4m3"}, "near")]
CELLS = {
    "llama": [({"speculative": "draft_model"}, "same"), ({"speculative": "dflash"}, "same"),
              ({"enable_prefix_caching": False}, "same"), ({"kv_cache_dtype": "fp8_e5m2"}, "near"),
              ({"kv_cache_dtype": "bfloat16"}, "near"),
              ({"dtype": "bfloat16"}, "near")],
    "qwen2": [({"enable_prefix_caching": False}, "same")],
    "qwen3": [({"speculative": "dflash"}, "same"), ({"enable_prefix_caching": False}, "same")],
    "qwen3_moe": [({"speculative": "draft_model"}, "same"), ({"enable_prefix_caching": False}, "same")],
    "qwen3_5": [({"speculative": "draft_model"}, "same"), ({"speculative": "dflash"}, "same"),
                ({"mamba_cache_mode": "align"}, "same"), ({"dtype": "bfloat16"}, "near")],
    "qwen3_5_moe": [({"speculative": "dflash"}, "same"), ({"mamba_cache_mode": "align"}, "same")],
}


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_cells_that_run_give_the_reference_tokens(arch, models):
    reference = models.with_facts(example(arch, "cpu", dtype="float32"))
    ref, _ = generate(models.open(reference))
    for changes, compare in EVERY_ARCHITECTURE + CELLS[arch]:
        c = reference.with_(**changes)
        assert not check(c), changes  # the matrix says it runs
        out, info = generate(models.open(c))
        if compare == "same":
            assert [o.token_ids for o in out] == [o.token_ids for o in ref], changes
        else:
            same_tokens_or_near_tie(ref, out, NEAR_TIE, changes)
        expected = {"cuda-graphs-on-cpu"} if "cuda_graph" in changes else set()
        expected |= {"hybrid-prefix-caching-off"} if c.hybrid and c.mamba_cache_mode == "none" else set()
        assert {f.name for f in fallbacks(c)} == expected
        if "cuda_graph" in changes:  # the fallback the matrix declares: steps run eagerly on the CPU
            assert info["cuda_graph"] is False
        prefix_caching = c.enable_prefix_caching and "hybrid-prefix-caching-off" not in expected
        assert info["enable_prefix_caching"] == prefix_caching


def test_an_attention_backend_off_its_device_falls_back_to_the_reference_backend(models):
    reference = example("qwen3", "cpu", dtype="float32", attention_backend="TORCH_SDPA_REF")
    ref, _ = generate(models.open(reference))
    for backend in ("TRITON_PAGED", "FLASH_ATTN_V100"):
        c = reference.with_(attention_backend=backend)
        assert not check(c) and [f.name for f in fallbacks(c)] == ["attention-backend-off-its-device"]
        out, info = generate(models.open(c))
        assert info["attention_backend"]["effective"] == "TORCH_SDPA_REF"
        assert [o.token_ids for o in out] == [o.token_ids for o in ref]


def test_packed_and_gguf_weights_give_the_tokens_of_their_dense_twin(models):
    """quantization w4a16 (a dense checkpoint quantized at load) and gguf (Q4_0/Q4_1/Q8_0 blocks kept packed) run
    in the CPU int4 layer, which rounds activations and scales to bfloat16: the tokens of the dequantized weights
    up to a near-tie. A .gguf file read dequantized gives its dense twin's tokens exactly."""
    from onecat.engine import LLM

    llama = example("llama", "cpu", dtype="float32")
    hybrid = models.with_facts(example("qwen3_5", "cpu", dtype="float32"))
    cases = [(llama.with_(quantization="w4a16"), models.w4a16_twin, "near"),
             (llama.with_(quantization="gguf", checkpoint="gguf"), models.llama_q4_dequantized, "near"),
             (llama.with_(checkpoint="gguf"), models.llama_q4_dequantized, "same"),
             (hybrid.with_(checkpoint="gguf"), DATA / "tiny-qwen35", "same")]
    for c, twin, compare in cases:
        assert not check(c), c
        out, info = generate(models.open(c))
        ref, _ = generate(LLM(str(twin), **models.settings(c.with_(quantization=None))))
        if c.quantization is not None:  # packed: a count (w4a16) or counts per GGUF type
            packed = info["quantization"]["packed_linears"]
            assert (sum(packed.values()) if isinstance(packed, dict) else packed) > 0, info["quantization"]
        if compare == "same":
            assert [o.token_ids for o in out] == [o.token_ids for o in ref], c
        else:
            same_tokens_or_near_tie(ref, out, PACKED_NEAR_TIE, c)


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5_moe"])
def test_tensor_parallel_cells_give_the_reference_tokens(arch, models):
    """Two CPU ranks over gloo: the one-rank tokens, up to a near-tie of float32 summation order."""
    reference = models.with_facts(example(arch, "cpu", dtype="float32"))
    c = reference.with_(tensor_parallel_size=2)
    assert not check(c)
    ref, _ = generate(models.open(reference))
    out, info = generate(models.open(c))
    assert info["tensor_parallel"] is not None
    same_tokens_or_near_tie(ref, out, NEAR_TIE, c)
