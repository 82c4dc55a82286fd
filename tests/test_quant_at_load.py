"""Quantization at load (engine/quant/rtn.py): each format rounds a dense weight to the nearest value it can
hold, and `quantization` with random weights (load_format dummy) packs the very weights the dense engine
draws with the same seed; formats that pack only their own checkpoints stay refused with dummy weights."""
from __future__ import annotations

import pytest
import torch

from onecat.engine import LLM, SamplingParams
from onecat.engine.errors import ConfigError
from onecat.engine.quant.bits import E2M1_VALUES
from onecat.engine.quant.fp4.layout import block_scales, dequantize as fp4_dequantize
from onecat.engine.quant.fp8.layout import dequantize as fp8_dequantize
from onecat.engine.quant.rtn import quantize
from onecat.engine.quant.w4a16.layout import dequantize as w4a16_dequantize

DEQUANTIZE = {"w4a16": w4a16_dequantize, "nvfp4": fp4_dequantize, "mxfp4": fp4_dequantize, "fp8": fp8_dequantize}
E2M1 = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES))


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ONECAT_CACHE_DIR", str(tmp_path / "cache"))


def weight() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randn(48, 256, generator=g) * torch.rand(48, 1, generator=g) * 0.05


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_fp4_rounds_each_value_to_the_nearest_one_its_block_holds(fmt):
    w = weight()
    q = quantize(w, fmt)
    scale = block_scales(q).repeat_interleave(q.block, dim=1)  # [N, K]
    candidates = E2M1.view(1, 1, -1) * scale.unsqueeze(-1)  # what each position could hold
    nearest = candidates.gather(-1, (candidates - w.unsqueeze(-1)).abs().argmin(-1, keepdim=True)).squeeze(-1)
    torch.testing.assert_close(fp4_dequantize(q), nearest, rtol=0, atol=1e-7)
    assert ((fp4_dequantize(q) - w).norm() / w.norm()) < 0.15
    if fmt == "mxfp4":  # power-of-two scales that put each block's largest value in [4, 8) before rounding
        top = (w.reshape(48, -1, 32).abs().amax(-1) / block_scales(q))
        assert bool(((top >= 4) & (top < 8)).all())


def test_fp8_keeps_a_scale_per_row_and_rounds_within_e4m3():
    w = weight()
    q = quantize(w, "fp8")
    assert q.scale.shape == (48,)
    torch.testing.assert_close(q.scale, w.abs().amax(1) / 448)
    dq = fp8_dequantize(q)
    expect = (w / q.scale[:, None]).to(torch.float8_e4m3fn).float() * q.scale[:, None]
    torch.testing.assert_close(dq, expect, rtol=0, atol=0)


def test_layers_a_format_cannot_take_are_none():
    odd = torch.randn(8, 40)
    assert quantize(odd, "nvfp4") is None and quantize(odd, "fp8") is None and quantize(odd, "w4a16") is None


def dense_weights(model: str, monkeypatch) -> dict[str, torch.Tensor]:
    """The dense engine's random weights, as drawn (not handed to oneDNN's layout, which keeps no copy)."""
    import onecat.engine.worker.worker as worker

    with monkeypatch.context() as m:
        m.setattr(worker, "pack_weights", lambda model: None)
        with LLM(model, load_format="dummy", max_model_len=64) as llm:
            return {n: p.detach().clone() for n, p in llm.model.named_parameters()}


@pytest.mark.parametrize("fmt", ["w4a16", "nvfp4", "mxfp4", "fp8"])
def test_random_weights_are_quantized_at_load(monkeypatch, fmt):
    """tiny-qwen3.5-moe: dense projections, Gated DeltaNet projections and experts come out packed; each packed
    linear holds the rounding of the weight the dense engine draws with the same seed."""
    import onecat.engine.quant.hf_packer as packer
    import onecat.engine.quant.quantization as quantization

    monkeypatch.setattr(quantization, "check_w4a16", lambda *a: None)  # FP4/FP8: the CPU reference layers
    monkeypatch.setattr(packer, "CPU_INT4_KERNEL", False)  # W4A16: the exactly dequantized layer
    model = "random:tiny-qwen3.5-moe"
    dense = dense_weights(model, monkeypatch)
    with LLM(model, load_format="dummy", quantization=fmt, max_model_len=64) as llm:
        info = llm.info()["quantization"]
        out = llm.generate(["t5 t6 t7"], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))[0]
        o_proj = llm.model.get_submodule("layers.3.self_attn.o_proj")
        want = quantize(dense["layers.3.self_attn.o_proj.weight"], fmt)
        got = DEQUANTIZE[fmt](o_proj.packed().to("cpu"))
    assert info["source"].startswith(f"round-to-nearest {'w4 g' if fmt == 'w4a16' else fmt}"), info
    assert info["source"].endswith("at load"), info
    assert info["packed_linears"] > 0 and info["packed_experts"] == 4, info
    assert len(out.token_ids) == 6
    torch.testing.assert_close(got, DEQUANTIZE[fmt](want), rtol=0, atol=0)


def test_each_module_is_packed_as_soon_as_it_is_rounded(monkeypatch):
    """The dense weights leave one module at a time: when a linear or a layer's experts are rounded, every one
    rounded before is already packed (the load's peak is the dense model and one module's packed weights)."""
    import onecat.engine.quant.hf_packer as packer
    import onecat.engine.quant.quantization as quantization

    monkeypatch.setattr(quantization, "check_w4a16", lambda *a: None)
    monkeypatch.setattr(packer, "CPU_INT4_KERNEL", False)
    rounded, still_dense = [], []
    share, experts = packer._quantize_share, packer._quantize_experts

    def dense_now(model):
        return {n for n, m in model.named_modules() if n in rounded and (isinstance(m, torch.nn.Linear) or
                                                                         type(m).__name__ == "Experts")}

    def recording_share(model, path, module, start, rows, fmt):
        still_dense.append(dense_now(model) - {path})
        if path not in rounded:
            rounded.append(path)
        return share(model, path, module, start, rows, fmt)

    monkeypatch.setattr(packer, "_quantize_share", recording_share)
    monkeypatch.setattr(packer, "_quantize_experts", lambda m, fmt, path: rounded.append(path) or experts(m, fmt, path))
    with LLM("random:tiny-qwen3.5-moe", load_format="dummy", quantization="nvfp4", max_model_len=64) as llm:
        info = llm.info()["quantization"]
        remaining = dense_now(llm.model)
    assert len(rounded) > 10 and info["packed_experts"] == 4
    assert not any(still_dense), [d for d in still_dense if d][:3]
    assert not remaining


def test_formats_that_pack_their_own_checkpoints_refuse_random_weights():
    with pytest.raises(ConfigError, match=r"packed-weights-dummy.*quantizes at load|quantizes at load"):
        LLM("random:tiny-llama", load_format="dummy", quantization="awq", max_model_len=64)


def test_speculation_over_packed_cpu_weights_keeps_the_tokens_at_sixteen_and_more_verify_rows():
    """The CPU 4-bit layer switches kernels at 16 rows; a verify step counts its sequences, not its 1 + k rows
    each, so speculation gives target-only's tokens at batch 1 and 3 with 16 rows a sequence."""
    prompts = ["t5 t6 t7 t8", "t9 t10 t11", "t12 t13 t14 t15 t16"]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    settings = dict(load_format="dummy", quantization="w4a16", max_model_len=128)
    with LLM("random:tiny-llama", **settings) as plain:
        want = [o.token_ids for o in plain.generate(prompts, params)]
    spec = {"method": "synthetic", "num_speculative_tokens": 15, "acceptance_length": 9.5,
            "disable_when_slower": False}
    with LLM("random:tiny-llama", speculative_config=spec, **settings) as llm:
        for batch in (prompts[:1], prompts):
            llm.generate(batch, params)  # learns the continuations
            outs = llm.generate(batch, params)
            assert [o.token_ids for o in outs] == want[:len(batch)]
            assert sum(o.spec.num_accepted_tokens for o in outs) > 0
