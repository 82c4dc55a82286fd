"""Packed weights on the MoE and hybrid architectures (qwen3_moe, qwen3_5, qwen3_5_moe): the dense projections
(attention, Gated DeltaNet in/out, dense MLPs, the shared expert) and every MoE expert stay packed, the routers,
gates and the DeltaNet's beta/decay rows stay dense, and the packed engine gives the tokens of the same checkpoint
run with its packed weights dequantized.

The CPU tests run the CUDA layers (W4A16Linear, FP4Linear, FP8Linear), which compute on the exactly dequantized
weight there, so the packed engine matches the dequantized one up to summation order (the near-tie rule for the
tokens); the CPU int4 kernel (bf16 scales and activations) is checked within its own tolerance, and the GPU test
runs the packed GEMVs."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from onecat.engine.quant.w4a16.layout import dequantize, quantize_w4

pytest.importorskip("transformers")  # the tiny checkpoints are written by transformers

ARCHS = ("qwen3_moe", "qwen3_5", "qwen3_5_moe")
# sizes every format's groups divide: hidden 64, expert and shared-expert intermediate 64, dense MLP 128
SIZES = dict(moe_intermediate_size=64, intermediate_size=128, shared_expert_intermediate_size=64)
DENSE_BY_DESIGN = ("mlp.gate", "shared_expert_gate", "in_proj_b", "in_proj_a")  # routers, gates, beta/decay rows
PROMPTS = [[5, 17, 99, 3], list(range(10, 37)), [200]]
W4A16_CASES = ("awq", "gptq-sym", "ct-asym")


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """arch -> (the tiny dense checkpoint, its state dict), built once per module."""
    from tests.tiny_moe_hybrid import make_tiny_moe_hybrid

    built = {}

    def get(arch: str):
        if arch not in built:
            d = make_tiny_moe_hybrid(arch, tmp_path_factory.mktemp(arch), **SIZES)
            built[arch] = d, load_file(str(d / "model.safetensors"))
        return built[arch]

    return get


def quantizable(state: dict[str, torch.Tensor]) -> list[str]:
    """The decoder linears a checkpoint stores quantized: all but the routers, gates and beta/decay rows."""
    return [k[: -len(".weight")] for k, v in state.items() if k.endswith(".weight") and v.dim() == 2
            and ".layers." in k and not k.removesuffix(".weight").endswith(DENSE_BY_DESIGN)]


def write(src: Path, out: Path, state: dict[str, torch.Tensor], quant_config: dict | None) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (src / name).exists():
            shutil.copy(src / name, out / name)
    config = json.loads((src / "config.json").read_text())
    if quant_config is not None:
        config["quantization_config"] = quant_config
    (out / "config.json").write_text(json.dumps(config, indent=1))
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"))
    return out


def quantized_checkpoint(src: Path, state: dict, out: Path, quantize, config: dict) -> Path:
    """src with every quantizable linear replaced by `quantize(weight)`'s stored parts."""
    stored = dict(state)
    for module in quantizable(state):
        del stored[f"{module}.weight"]
        stored.update({f"{module}.{p}": t for p, t in quantize(state[f"{module}.weight"]).items()})
    return write(src, out, stored, config)


def rtn_reference(src: Path, state: dict, out: Path) -> Path:
    """The dense twin of quantization='w4a16' at load: each packed linear's rows rounded to nearest (per row,
    so per checkpoint shard or fused alike) and dequantized, in the groups the packer picks."""
    ref = dict(state)
    for module in quantizable(state):
        w = state[f"{module}.weight"]
        group = next(g for g in (128, 64, 32) if w.shape[1] % g == 0)
        ref[f"{module}.weight"] = dequantize(quantize_w4(w, group))
    return write(src, out, ref, None)


def generate(path: Path, device: str = "cpu", dtype: str = "float32", **settings):
    from onecat.engine import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=5, prompt_logprobs=0)
    with LLM(str(path), dtype=dtype, device=device, enable_prefix_caching=False, max_model_len=64,
             **settings) as llm:
        outs = llm.generate(PROMPTS, params)
        return outs, llm.info()["quantization"], llm.model


def compare(packed, dense, atol: float, near_tie: float) -> None:
    """Prompt logprobs within atol; greedy tokens equal, or parting at a near tie (tests/test_support_matrix.py)."""
    from tests.test_support_matrix import same_tokens_or_near_tie

    for a, b in zip(packed, dense):
        assert torch.allclose(torch.tensor(a.prompt_logprobs[1:]), torch.tensor(b.prompt_logprobs[1:]),
                              rtol=0, atol=atol)
    same_tokens_or_near_tie(dense, packed, near_tie, "packed vs dequantized")


def expected_layout(arch: str, model, info: dict, packed_kind: type) -> None:
    """Every expert set packed, the DeltaNet in_proj packed beside its dense beta/decay rows, routers and gates
    dense, nothing else left dense."""
    from onecat.engine.layers.linear import Linear
    from onecat.engine.layers.moe import Experts, PackedExperts
    from onecat.engine.quant.row_split import RowSplitLinear

    moe = [m for m in model.modules() if isinstance(m, (Experts, PackedExperts))]
    assert all(isinstance(m, PackedExperts) for m in moe) and info.get("packed_experts", 0) == len(moe)
    assert (len(moe) > 0) == (arch != "qwen3_5")
    assert info["kept_dense"] == []
    for name, m in model.named_modules():
        leaf = name.rpartition(".")[2]
        if leaf == "linear_attn":  # [q | k | v | z] packed, [b | a] (one row per value head each) dense
            assert isinstance(m.in_proj, RowSplitLinear) and isinstance(m.in_proj.parts[0], packed_kind), name
            assert type(m.in_proj.parts[1]) is Linear and m.in_proj.parts[1].out_features == 2 * m.v_heads
        elif leaf in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "out_proj") and name.startswith("layers."):
            assert isinstance(m, packed_kind), name
        elif leaf in ("gate", "shared_expert_gate"):
            assert type(m) is Linear, name


@pytest.fixture
def exact_cpu_layers(monkeypatch):
    """W4A16 through W4A16Linear (the exactly dequantized weight) instead of the CPU int4 kernel."""
    import onecat.engine.quant.hf_packer as packer

    monkeypatch.setattr(packer, "CPU_INT4_KERNEL", False)


@pytest.fixture
def lift_cpu_refusal(monkeypatch):
    """nvfp4 / mxfp4 / fp8 are refused on CPU (no fast kernel); their layers compute the dequantized reference
    there, which is what these tests check the packing with."""
    import onecat.engine.quant.quantization as quantization

    monkeypatch.setattr(quantization, "check_w4a16", lambda *a: None)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("case", W4A16_CASES)
def test_w4a16_checkpoint_runs_packed(sources, tmp_path, exact_cpu_layers, arch, case):
    from onecat.engine.quant.w4a16.linear import W4A16Linear
    from tests.w4a16_checkpoints import stored_linear

    src, state = sources(arch)
    fmt = stored_linear(case, state[f"{quantizable(state)[0]}.weight"])[0]
    qdir = quantized_checkpoint(src, state, tmp_path / case, lambda w: stored_linear(case, w)[1], fmt.config)
    dense, _, _ = generate(qdir)
    packed, info, model = generate(qdir, quantization="w4a16")
    compare(packed, dense, atol=1e-4, near_tie=1e-3)
    expected_layout(arch, model, info, W4A16Linear)


@pytest.mark.parametrize("arch", ARCHS)
def test_quantized_at_load_matches_its_dequantized_twin(sources, tmp_path, exact_cpu_layers, arch):
    from onecat.engine.quant.w4a16.linear import W4A16Linear

    src, state = sources(arch)
    packed, info, model = generate(src, quantization="w4a16")
    dense, _, _ = generate(rtn_reference(src, state, tmp_path / "rtn"))
    compare(packed, dense, atol=1e-4, near_tie=1e-3)
    expected_layout(arch, model, info, W4A16Linear)
    assert info["source"] == "round-to-nearest w4 g128/64 at load"


@pytest.mark.parametrize("arch", ARCHS)
def test_cpu_int4_kernel_tracks_the_dequantized_twin(sources, tmp_path, arch):
    """The CPU path as it runs: the int4 kernel rounds scales and activations to bf16, so close, not equal."""
    from onecat.engine.quant.int4.linear import Int4PackedLinear

    if not Int4PackedLinear.supported(torch.device("cpu")):
        pytest.skip("this torch has no CPU int4 kernel")
    src, state = sources(arch)
    packed, info, model = generate(src, quantization="w4a16")
    dense, _, _ = generate(rtn_reference(src, state, tmp_path / "rtn"))
    compare(packed, dense, atol=0.05, near_tie=0.05)
    expected_layout(arch, model, info, Int4PackedLinear)


def fp_case(fmt: str):
    """(stored parts of one weight, quantization_config) of a CUDA-only format."""
    from tests.test_quant_formats_mxfp4 import mxfp4_quantize
    from tests.test_quant_formats_nvfp4 import fp8_quantize, nvfp4_quantize

    if fmt == "nvfp4":
        return (lambda w: nvfp4_quantize(w)[0]), {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16}
    if fmt == "mxfp4":
        return (lambda w: mxfp4_quantize(w)[0]), {"quant_method": "mxfp4"}
    return (lambda w: fp8_quantize(w)[0]), {"quant_method": "modelopt", "quant_algo": "FP8"}


@pytest.mark.parametrize("arch", ("qwen3_moe", "qwen3_5_moe"))
@pytest.mark.parametrize("fmt", ("nvfp4", "mxfp4", "fp8"))
def test_fp4_fp8_checkpoints_pack_the_experts(sources, tmp_path, lift_cpu_refusal, arch, fmt):
    from onecat.engine.quant.fp4.linear import FP4Linear
    from onecat.engine.quant.fp8.linear import FP8Linear

    src, state = sources(arch)
    quantize, config = fp_case(fmt)
    qdir = quantized_checkpoint(src, state, tmp_path / fmt, quantize, config)
    dense, _, _ = generate(qdir)
    packed, info, model = generate(qdir, quantization=fmt)
    compare(packed, dense, atol=1e-4, near_tie=1e-3)
    expected_layout(arch, model, info, FP8Linear if fmt == "fp8" else FP4Linear)


def packed_weight(fmt: str, w: torch.Tensor):
    """(packed weight, its layer class) of a dense [N, K] weight in a format's layout."""
    from onecat.engine.quant.fp4.layout import from_nvfp4
    from onecat.engine.quant.fp4.linear import FP4Linear
    from onecat.engine.quant.fp8.layout import pack_fp8
    from onecat.engine.quant.fp8.linear import FP8Linear
    from onecat.engine.quant.w4a16.linear import W4A16Linear
    from tests.test_quant_formats_nvfp4 import fp8_quantize, nvfp4_quantize

    if fmt == "w4a16":
        return quantize_w4(w, 32), W4A16Linear
    if fmt == "nvfp4":
        s = nvfp4_quantize(w)[0]
        return from_nvfp4(s["weight"], s["weight_scale"], s["weight_scale_2"]), FP4Linear
    s = fp8_quantize(w)[0]
    return pack_fp8(s["weight"], s["weight_scale"]), FP8Linear


def dense_of(layer) -> torch.Tensor:
    """The layer's dense weight as its CPU path computes with it: its outputs for the unit inputs (exact)."""
    return layer(torch.eye(layer.in_features)).t().contiguous()


@pytest.mark.parametrize("fmt", ("w4a16", "nvfp4", "fp8"))
def test_packed_experts_are_the_dense_experts_on_the_packed_weights(fmt):
    """One MoE layer: PackedExperts against Experts holding the exactly dequantized weights, at a step where
    some experts get no token."""
    from onecat.engine.layers.moe import Experts, PackedExperts

    g = torch.Generator().manual_seed(0)
    E, H, I, T = 4, 64, 64, 5
    gate_up = [packed_weight(fmt, torch.randn(2 * I, H, generator=g) * 0.1) for _ in range(E)]
    down = [packed_weight(fmt, torch.randn(H, I, generator=g) * 0.1) for _ in range(E)]
    dense = Experts(E, H, I)
    dense.gate_up_proj.data.copy_(torch.stack([dense_of(kind(w)) for w, kind in gate_up]))
    dense.down_proj.data.copy_(torch.stack([dense_of(kind(w)) for w, kind in down]))
    packed = PackedExperts([kind(w) for w, kind in gate_up], [kind(w) for w, kind in down], I)
    x = torch.randn(T, H, generator=g)
    ids = torch.tensor([[0, 2], [2, 0], [0, 2], [2, 0], [0, 2]])  # experts 1 and 3 idle
    weights = torch.rand(T, 2, generator=g)
    assert torch.allclose(packed(x, weights, ids), dense(x, weights, ids), rtol=0, atol=1e-6)
    assert packed.path == "packed_loop" and dense.path == "loop"


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("fmt", ("w4a16", "nvfp4", "mxfp4", "fp8"))
def test_packed_engine_on_cuda(sources, tmp_path, arch, fmt):
    """The packed GEMVs on CUDA (fp16 activations: GEMV float32 sums vs cuBLAS on the same fp16 weights)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from tests.gpu_kernels import require_fused_kernels

    require_fused_kernels()
    from onecat.engine.quant.fp4.linear import FP4Linear
    from onecat.engine.quant.fp8.linear import FP8Linear
    from onecat.engine.quant.w4a16.linear import W4A16Linear

    src, state = sources(arch)
    if fmt == "w4a16":
        packed, info, model = generate(src, "cuda", "float16", quantization="w4a16")
        dense, _, _ = generate(rtn_reference(src, state, tmp_path / "rtn"), "cuda", "float16")
    else:
        quantize, config = fp_case(fmt)
        qdir = quantized_checkpoint(src, state, tmp_path / fmt, quantize, config)
        packed, info, model = generate(qdir, "cuda", "float16", quantization=fmt)
        dense, _, _ = generate(qdir, "cuda", "float16")
    expected_layout(arch, model, info, {"w4a16": W4A16Linear, "fp8": FP8Linear}.get(fmt, FP4Linear))
    compare(packed, dense, atol=2e-2, near_tie=2e-2)


EXCLUDED = "model.layers.1.self_attn.o_proj"  # left unquantized by the mixed checkpoint (exclude_modules)


def mixed_checkpoint(src: Path, state: dict, out: Path) -> Path:
    """A ModelOpt MIXED_PRECISION export: FP8 dense projections, NVFP4 experts, EXCLUDED and the routers dense,
    the config in hf_quant_config.json as ModelOpt writes it."""
    from tests.test_quant_formats_nvfp4 import fp8_quantize, nvfp4_quantize

    stored, layers = dict(state), {}
    for module in quantizable(state):
        if module == EXCLUDED:
            continue
        nvfp4 = ".experts." in module
        del stored[f"{module}.weight"]
        stored.update({f"{module}.{p}": t for p, t in
                       (nvfp4_quantize if nvfp4 else fp8_quantize)(state[f"{module}.weight"])[0].items()})
        layers[module] = {"quant_algo": "NVFP4", "group_size": 16} if nvfp4 else {"quant_algo": "FP8"}
    write(src, out, stored, None)
    (out / "hf_quant_config.json").write_text(json.dumps({"producer": {"name": "modelopt", "version": "0.0"},
        "quantization": {"quant_algo": "MIXED_PRECISION", "quantized_layers": layers,
                         "exclude_modules": ["lm_head", EXCLUDED, "*.mlp.gate", "*.shared_expert_gate"]}}))
    return out


@pytest.mark.parametrize("name", ("nvfp4", "fp8"))
def test_modelopt_mixed_precision_stays_packed_layer_by_layer(sources, tmp_path, lift_cpu_refusal, name):
    from onecat.engine.layers.linear import Linear
    from onecat.engine.layers.moe import PackedExperts
    from onecat.engine.quant.fp4.linear import FP4Linear
    from onecat.engine.quant.fp8.linear import FP8Linear
    from onecat.engine.quant.row_split import RowSplitLinear

    src, state = sources("qwen3_5_moe")
    qdir = mixed_checkpoint(src, state, tmp_path / "mixed")
    dense, _, _ = generate(qdir)
    packed, info, model = generate(qdir, quantization=name)
    compare(packed, dense, atol=1e-4, near_tie=1e-3)
    assert info["source"] == "checkpoint modelopt mixed fp8/nvfp4" and info["kept_dense"] == []
    experts = [m for m in model.modules() if isinstance(m, PackedExperts)]
    assert len(experts) == 4 and all(isinstance(layer, FP4Linear) for m in experts for layer in [*m.gate_up, *m.down])
    layers = model.layers
    assert type(layers[1].self_attn.o_proj) is Linear  # stored dense: stays dense
    assert isinstance(layers[3].self_attn.o_proj, FP8Linear) and isinstance(layers[1].self_attn.qkv_proj, FP8Linear)
    assert isinstance(layers[0].linear_attn.in_proj, RowSplitLinear)
    assert isinstance(layers[0].linear_attn.in_proj.parts[0], FP8Linear)
    assert isinstance(layers[0].mlp.shared_expert.gate_up_proj, FP8Linear) and type(layers[0].mlp.gate) is Linear


def test_mixed_precision_config_refuses_what_it_cannot_read():
    from onecat.engine.errors import CorruptModelError, UnsupportedModelError
    from onecat.engine.quant.checkpoint_formats.modelopt import ModelOpt
    from tests.test_quant_formats_nvfp4 import fp8_quantize

    with pytest.raises(UnsupportedModelError, match="quant_algo 'W4A8_AWQ' for m is not supported"):
        ModelOpt({"quant_algo": "MIXED_PRECISION", "quantized_layers": {"m": {"quant_algo": "W4A8_AWQ"}}})
    with pytest.raises(UnsupportedModelError, match="needs quantized_layers"):
        ModelOpt({"quant_algo": "MIXED_PRECISION"})
    fmt = ModelOpt({"quant_algo": "MIXED_PRECISION", "quantized_layers": {"m": {"quant_algo": "NVFP4"}}})
    stored = fp8_quantize(torch.randn(16, 64))[0]
    with pytest.raises(CorruptModelError, match="quantized_layers says NVFP4 but it is stored as FP8"):
        fmt.dequantize("m", stored)
    with pytest.raises(CorruptModelError, match="quantized_layers does not list it"):
        fmt.dequantize("other", stored)
