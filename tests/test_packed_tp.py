"""Packed weights under tensor parallelism: each rank keeps (or rounds at load) only its share of every packed
linear, cut where the dense sharding cuts it (engine/quant/packed_shard.py).

A share of a packed weight dequantizes to exactly the slice of the full weight's dequantization; a share rounded at
load equals the slice of the full weight rounded at once (the loaders note what it needs of the rest); ranks
built in this process hold exactly those slices; and TP=2 engines give TP=1's tokens (up to float32 summation
order: the near-tie rule) from AWQ and NVFP4 checkpoints and from random weights quantized at load to W4A16 and FP8,
on a dense and a hybrid model."""
from __future__ import annotations

import pytest
import torch

from onecat.engine.errors import ConfigError
from onecat.engine.quant.fp4.layout import dequantize as fp4_dequantize
from onecat.engine.quant.fp8.layout import dequantize as fp8_dequantize
from onecat.engine.quant.packed_shard import note_full_weight, noted, packed_share, round_share
from onecat.engine.quant.rtn import quantize
from onecat.engine.quant.w4a16.layout import dequantize as w4a16_dequantize

DEQUANTIZE = {"w4a16": w4a16_dequantize, "nvfp4": fp4_dequantize, "mxfp4": fp4_dequantize, "fp8": fp8_dequantize}
PROMPTS = [[5, 17, 99, 3], list(range(10, 37))]


def weight(n: int = 24, k: int = 256, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05


# --------------------------------------------------------------------------- slicing a packed weight
@pytest.mark.parametrize("fmt", DEQUANTIZE)
def test_a_share_dequantizes_to_the_slice_of_the_dequantized_weight(fmt):
    w = weight()
    packed = quantize(w, fmt, **({"group": 64} if fmt == "w4a16" else {}))
    full = DEQUANTIZE[fmt](packed)
    rows = torch.tensor([1, 5, 6, 20])  # any rows: a column-parallel share (heads, units, fused parts)
    cols = torch.cat([torch.arange(64, 128), torch.arange(192, 256)])  # whole groups / blocks: row-parallel
    for r, c in ((rows, None), (None, cols), (rows, cols)):
        share = packed_share(packed, r, c, "layers.0.mlp.down_proj")
        expect = full if r is None else full[r]
        assert torch.equal(DEQUANTIZE[fmt](share), expect if c is None else expect[:, c])


def test_columns_that_cut_a_group_are_refused_naming_the_layer_and_the_group():
    packed = quantize(weight(), "w4a16", group=64)
    with pytest.raises(ConfigError, match=r"layers\.3\.self_attn\.o_proj .*64-column groups"):
        packed_share(packed, None, torch.arange(32, 96), "layers.3.self_attn.o_proj")
    with pytest.raises(ConfigError, match=r"16-column blocks"):
        packed_share(quantize(weight(), "nvfp4"), None, torch.arange(8, 40), "layers.0.mlp.down_proj")


def test_an_act_order_weight_is_cut_by_rows_but_stays_dense_when_cut_by_columns():
    from onecat.engine.quant.w4a16.layout import W4A16Weight

    packed = quantize(weight(), "w4a16", group=32)
    perm = torch.randperm(256, generator=torch.Generator().manual_seed(1)).int()
    act_order = W4A16Weight(packed.qweight, packed.scales, packed.zeros, 32, perm)
    rows = torch.arange(4, 12)
    assert torch.equal(w4a16_dequantize(packed_share(act_order, rows, None, "q")), w4a16_dequantize(act_order)[rows])
    assert packed_share(act_order, None, torch.arange(0, 128), "o") is None


# --------------------------------------------------------------------------- rounding a share at load
class Shard(torch.nn.Module):
    """A sharded linear as sharding.py leaves it: its share, and the records of the cut."""

    def __init__(self, full: torch.Tensor, rows, cols):
        super().__init__()
        w = full if rows is None else full[rows]
        self.weight = torch.nn.Parameter(w if cols is None else w[:, cols], requires_grad=False)
        self._tp_full, self._tp_rows, self._tp_cols = tuple(full.shape), rows, cols


@pytest.mark.parametrize("fmt", DEQUANTIZE)
@pytest.mark.parametrize("cut", ["rows", "cols", "cols cutting groups"])
def test_a_share_rounded_at_load_is_the_slice_of_the_full_weight_rounded(fmt, cut):
    """FP8's per-row and NVFP4's per-tensor scales come from the full weight, and a W4A16 share whose columns cut
    the full weight's 128-column groups rounds those groups whole: the slice of TP=1's rounding, exactly."""
    w = weight()
    rows = torch.tensor([0, 3, 4, 9, 17]) if cut == "rows" else None
    cols = {"rows": None, "cols": torch.arange(128, 256), "cols cutting groups": torch.arange(64, 192)}[cut]
    layer = Shard(w, rows, cols)
    note_full_weight(layer, w, 0)
    n = layer.weight.shape[0]
    share = round_share(layer.weight, fmt, "layers.0.mlp.down_proj", cols, 256, noted(layer, 0, n, [(0, 24)]))
    expect = DEQUANTIZE[fmt](quantize(w, fmt))
    expect = expect if rows is None else expect[rows]
    assert torch.equal(DEQUANTIZE[fmt](share), expect if cols is None else expect[:, cols])


# --------------------------------------------------------------------------- ranks built in this process
def build_rank(source: str, quantization: str, rank: int, world: int, dummy: bool, monkeypatch):
    """The packed model one rank builds (as Worker._build_model does, without a process group), with what each
    packed layer cut of the full weight ({module: (rows, cols)}; an expert's gate_up / down layers: by the units
    of their Experts)."""
    import onecat.engine.quant.hf_packer as hf_packer
    from onecat.engine.loader import open_checkpoint
    from onecat.engine.loader.dummy import fill_random_weights
    from onecat.engine.model_source import resolve_model_source
    from onecat.engine.models.registry import model_class
    from onecat.engine.parallel.collectives import Collectives
    from onecat.engine.parallel.shard_loading import ShardLoader
    from onecat.engine.parallel.sharding import shard_model

    monkeypatch.setattr(hf_packer, "CPU_INT4_KERNEL", False)  # W4A16Linear: the exactly dequantized weight
    packer = hf_packer.W4A16Packer(quantization)
    ckpt = open_checkpoint(resolve_model_source(source, weights_required=not dummy), on_quantized=packer.keep)
    with torch.device("meta"):
        model = model_class(ckpt.config.architecture)(ckpt.config, 64)
    loader = None
    if world > 1:
        shard_model(model, rank, world, Collectives())
        loader = ShardLoader(model)
        packer.tensor_parallel(loader)
    model = model.to_empty(device="cpu").float()
    if ckpt.config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    if dummy:
        fill_random_weights(model, 0)
    else:
        model.load_weights(loader.weights(ckpt.weights) if loader else ckpt.weights)
    cuts = {n: (getattr(m, "_tp_rows", None), getattr(m, "_tp_cols", None)) for n, m in model.named_modules()}
    for n, m in model.named_modules():
        units = getattr(m, "_tp_units", None)
        if units is not None:
            for e in range(m.num_experts):
                cuts[f"{n}.gate_up.{e}"] = (torch.cat([units, m._tp_intermediate + units]), None)
                cuts[f"{n}.down.{e}"] = (None, units)
    packer.apply(model)
    return model, cuts


def packed_layers(model) -> dict[str, torch.nn.Module]:
    from onecat.engine.quant.fp4.linear import FP4Linear
    from onecat.engine.quant.fp8.linear import FP8Linear
    from onecat.engine.quant.row_split import RowSplitLinear
    from onecat.engine.quant.w4a16.linear import W4A16Linear

    kinds = (W4A16Linear, FP4Linear, FP8Linear, RowSplitLinear)
    return {n: m for n, m in model.named_modules() if isinstance(m, kinds) and not n.endswith(".parts.0")
            and ".parts." not in n}


def packed_experts(model) -> int:
    from onecat.engine.layers.moe import PackedExperts

    return sum(isinstance(m, PackedExperts) for m in model.modules())


def dense_of(layer) -> torch.Tensor:
    """The weight a layer computes with: its outputs for the unit inputs (forward itself: no collective hook)."""
    return layer.forward(torch.eye(layer.in_features)).t()


@pytest.mark.parametrize("source,quantization,dummy", [
    ("random:tiny-llama", "w4a16", True),  # o_proj / down_proj shares cut the 64 / 128-column groups
    ("random:tiny-llama", "nvfp4", True),  # the tensor scale of the full weight
    ("random:tiny-qwen3.5", "w4a16", True),  # Gated DeltaNet in_proj (beside its dense beta/decay rows), out_proj
    ("awq", "w4a16", False),
    ("awq moe", "w4a16", False),  # experts' gate/up rows and down columns by units, the hybrid's projections
])
def test_each_ranks_packed_layers_are_slices_of_the_one_rank_model(source, quantization, dummy, tmp_path,
                                                                   monkeypatch):
    if source == "awq":
        source = str(awq_checkpoint(tmp_path))
    elif source == "awq moe":
        source = str(awq_moe_checkpoint(tmp_path))
    full, _ = build_rank(source, quantization, 0, 1, dummy, monkeypatch)
    whole = packed_layers(full)
    assert whole and packed_experts(full) == (2 if source.endswith("awq-moe") else 0)  # one per layer
    for rank in range(2):
        model, cuts = build_rank(source, quantization, rank, 2, dummy, monkeypatch)
        mine = packed_layers(model)
        assert packed_experts(model) == packed_experts(full)
        assert mine.keys() <= whole.keys() and len(mine) >= len(whole) - 4  # FP4: a 32-wide share stays dense
        for name, layer in mine.items():
            rows, cols = cuts[name]
            expect = dense_of(whole[name])
            expect = expect if rows is None else expect[rows]
            assert torch.equal(dense_of(layer), expect if cols is None else expect[:, cols]), (rank, name)


# --------------------------------------------------------------------------- engines: TP=2 against TP=1
def awq_checkpoint(tmp_path):
    """The tiny Llama (MLP width 128: 64 per rank, whole 32-column groups) with its decoder linears in AWQ."""
    from tests.quant_checkpoints import linear_modules, quantized_dir, tiny_llama
    from tests.w4a16_checkpoints import stored_linear

    src, state = tiny_llama(tmp_path / "src", intermediate_size=128)
    stored = {m: stored_linear("awq", state[f"{m}.weight"]) for m in linear_modules(state)}
    fmt = next(iter(stored.values()))[0]
    return quantized_dir(src, tmp_path / "awq", {m: parts for m, (_, parts) in stored.items()}, fmt.config)


def awq_moe_checkpoint(tmp_path):
    """The tiny Qwen3.5-MoE (expert width 64: 32 per rank) with its decoder linears and experts in AWQ."""
    from safetensors.torch import load_file

    from tests.test_packed_moe_hybrid import SIZES, quantized_checkpoint
    from tests.tiny_moe_hybrid import make_tiny_moe_hybrid
    from tests.w4a16_checkpoints import stored_linear

    src = make_tiny_moe_hybrid("qwen3_5_moe", tmp_path / "moe", num_hidden_layers=2,
                               layer_types=["linear_attention", "full_attention"], **SIZES)
    state = load_file(str(src / "model.safetensors"))
    config = stored_linear("awq", state["model.layers.0.mlp.experts.0.down_proj.weight"])[0].config
    return quantized_checkpoint(src, state, tmp_path / "awq-moe", lambda w: stored_linear("awq", w)[1], config)


def nvfp4_checkpoint(tmp_path):
    from tests.quant_checkpoints import linear_modules, quantized_dir, tiny_llama
    from tests.test_quant_formats_nvfp4 import nvfp4_quantize

    src, state = tiny_llama(tmp_path / "src", intermediate_size=128)
    stored = {m: nvfp4_quantize(state[f"{m}.weight"])[0] for m in linear_modules(state)}
    return quantized_dir(src, tmp_path / "nvfp4", stored,
                         {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16})


@pytest.fixture
def every_rank_exact(tmp_path, monkeypatch):
    """In every rank's process: W4A16 through W4A16Linear (the exactly dequantized weight, not the CPU int4
    kernel's bf16 rounding) and the CPU refusal of FP8 / FP4 lifted (their layers compute the dequantized
    reference on CPU). monkeypatch reaches this process only; the worker ranks, which rank 0 starts with its
    environment, import a sitecustomize that makes the same changes."""
    import os

    import onecat.engine.quant.hf_packer as hf_packer
    import onecat.engine.quant.quantization as quantization

    monkeypatch.setattr(hf_packer, "CPU_INT4_KERNEL", False)
    monkeypatch.setattr(quantization, "check_w4a16", lambda *a: None)
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import onecat.engine.quant.hf_packer as hf_packer\n"
        "import onecat.engine.quant.quantization as quantization\n"
        "hf_packer.CPU_INT4_KERNEL = False\n"
        "quantization.check_w4a16 = lambda *a: None\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p))


def run(source: str, tp: int, **settings):
    from onecat.engine import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=5, prompt_logprobs=0)
    with LLM(source, dtype="float32", max_model_len=64, tensor_parallel_size=tp, **settings) as llm:
        return llm.generate(PROMPTS, params), llm.info()["quantization"]


@pytest.mark.parametrize("case", ["awq", "nvfp4", "w4a16 at load", "fp8 at load", "w4a16 at load, hybrid"])
def test_tp2_packed_gives_the_tp1_packed_tokens(case, tmp_path, every_rank_exact):
    from tests.test_support_matrix import NEAR_TIE, same_tokens_or_near_tie

    if case == "awq":
        source, settings = str(awq_checkpoint(tmp_path)), {"quantization": "w4a16"}
    elif case == "nvfp4":
        source, settings = str(nvfp4_checkpoint(tmp_path)), {"quantization": "nvfp4"}
    else:
        source = "random:tiny-qwen3.5" if "hybrid" in case else "random:tiny-llama"
        settings = {"quantization": case.split()[0], "load_format": "dummy"}
    one, info = run(source, 1, **settings)
    two, info2 = run(source, 2, **settings)
    assert info["packed_linears"] > 0 and info2["packed_linears"] > 0
    for a, b in zip(one, two):
        assert torch.allclose(torch.tensor(a.prompt_logprobs[1:]), torch.tensor(b.prompt_logprobs[1:]),
                              rtol=0, atol=1e-4)
    same_tokens_or_near_tie(one, two, NEAR_TIE, case)
