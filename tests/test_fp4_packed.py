"""quantization='nvfp4' / 'mxfp4': the packed FP4 layout holds the checkpoint's values exactly, the engine
keeps an NVFP4 (ModelOpt) or MXFP4 checkpoint's linears packed (fused q/k/v and gate/up stacked, each
NVFP4 shard keeping its global scale), and refusals name what to use. As in test_w4a16_engine.py the CPU
tests lift the CUDA-only check; FP4Linear then computes on the exactly dequantized weight, so the packed
engine must give the dequantized engine's logprobs. The GPU engine test runs the FP4 GEMV."""
from __future__ import annotations

import pytest
import torch

from onecat.engine.errors import ConfigError
from onecat.engine.quant.checkpoint_formats.modelopt import ModelOpt
from onecat.engine.quant.checkpoint_formats.mxfp4 import MXFP4
from onecat.engine.quant.fp4.layout import cat_fp4, dequantize, from_mxfp4, from_nvfp4
from onecat.engine.quant.fp4.linear import FP4Linear, dense_on_device
from onecat.engine.quant.fp4.packing import fp4_unsupported_reason

pytest.importorskip("transformers")  # the tiny checkpoints are written by transformers


def nvfp4_parts(n: int, k: int, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    scale = (torch.rand(n, k // 16, generator=gen) * 3 + 2.0**-9).to(torch.float8_e4m3fn)
    scale[0, 0] = 2.0**-9  # an E4M3 subnormal
    return {"weight": torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen),
            "weight_scale": scale, "weight_scale_2": torch.tensor(0.013 + seed * 1e-3)}


def mxfp4_parts(n: int, k: int, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    scales = torch.randint(118, 128, (n, k // 32), dtype=torch.uint8, generator=gen)
    scales[0, 0] = 0  # 2^-127, a float32 subnormal
    return {"weight_blocks": torch.randint(0, 256, (n, k // 32, 16), dtype=torch.uint8, generator=gen),
            "weight_scales": scales}


def test_layouts_hold_the_checkpoint_values_exactly():
    nv = nvfp4_parts(24, 128, 1)
    ref = ModelOpt({"quant_algo": "NVFP4"}).dequantize("m", nv)
    assert torch.equal(dequantize(from_nvfp4(nv["weight"], nv["weight_scale"], nv["weight_scale_2"])), ref)
    mx = mxfp4_parts(24, 128, 2)
    w = from_mxfp4(mx["weight_blocks"], mx["weight_scales"])
    assert torch.equal(dequantize(w), MXFP4({}).dequantize("m", mx))
    assert torch.equal(dense_on_device(w, torch.float32), dequantize(w))
    x = torch.randn(3, 128)
    assert torch.allclose(FP4Linear(w)(x), x @ dequantize(w).t(), rtol=1e-6, atol=1e-6)


def test_fused_nvfp4_shards_keep_their_global_scales():
    a, b = nvfp4_parts(16, 64, 3), nvfp4_parts(8, 64, 4)
    wa = from_nvfp4(a["weight"], a["weight_scale"], a["weight_scale_2"])
    wb = from_nvfp4(b["weight"], b["weight_scale"], b["weight_scale_2"])
    fused = cat_fp4([wa, wb])
    assert torch.equal(dequantize(fused), torch.cat([dequantize(wa), dequantize(wb)]))
    assert cat_fp4([wa, from_mxfp4(**{"blocks": mxfp4_parts(8, 64, 5)["weight_blocks"],
                                      "scales": mxfp4_parts(8, 64, 5)["weight_scales"]})]) is None


def test_what_the_gemv_cannot_take_stays_dense():
    mx = mxfp4_parts(8, 64, 6)
    mx["weight_scales"][0, 0] = 229  # 2^102: the GEMV's scale decode would overflow
    assert "scale exponent above 228" in fp4_unsupported_reason(from_mxfp4(mx["weight_blocks"], mx["weight_scales"]))
    nv = nvfp4_parts(8, 96, 7)
    assert "not a multiple of 64" in fp4_unsupported_reason(from_nvfp4(nv["weight"], nv["weight_scale"],
                                                                      nv["weight_scale_2"]))
    with pytest.raises(ValueError, match="expected uint8 \\[N, K/2\\] and float8_e4m3fn"):
        from_nvfp4(nv["weight"], nv["weight_scale"][:, :-1], nv["weight_scale_2"])


def fp4_dir(tmp_path, fmt: str):
    from tests.quant_checkpoints import linear_modules, quantized_dir, tiny_llama
    from tests.test_quant_formats_mxfp4 import CONFIG, mxfp4_quantize
    from tests.test_quant_formats_nvfp4 import nvfp4_quantize

    src, state = tiny_llama(tmp_path / "src", hidden_size=128, intermediate_size=256)
    quantize = nvfp4_quantize if fmt == "nvfp4" else mxfp4_quantize
    stored = {m: quantize(state[f"{m}.weight"])[0] for m in linear_modules(state)}
    config = {"quant_algo": "NVFP4", "group_size": 16, "quant_method": "modelopt"} if fmt == "nvfp4" else CONFIG
    return quantized_dir(src, tmp_path / fmt, stored, config)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_packed_fp4_engine_gives_the_dequantized_logprobs(tmp_path, fmt):
    import onecat.engine.quant.quantization as quantization
    from tests.test_w4a16_engine import prompt_logprobs

    qdir = fp4_dir(tmp_path, fmt)
    dense, _ = prompt_logprobs(qdir)
    mp = pytest.MonkeyPatch()
    mp.setattr(quantization, "check_w4a16", lambda *a: None)
    try:
        packed, info = prompt_logprobs(qdir, quantization=fmt)
    finally:
        mp.undo()
    for a, b in zip(packed, dense):
        assert torch.allclose(a, b, rtol=0, atol=1e-5)
    # per layer qkv, o, gate_up, down, less layer 1's down (stored dense)
    assert info["method"] == fmt and info["packed_linears"] == 7 and info["kept_dense"] == []


def test_fp4_names_refuse_other_checkpoints(tmp_path):
    import onecat.engine.quant.quantization as quantization
    from onecat.engine import LLM

    qdir = fp4_dir(tmp_path, "mxfp4")
    with pytest.raises(ConfigError, match="CUDA 4-bit GEMV kernels"):
        LLM(str(qdir), quantization="mxfp4", dtype="float32")
    mp = pytest.MonkeyPatch()
    mp.setattr(quantization, "check_w4a16", lambda *a: None)
    try:
        with pytest.raises(ConfigError, match="quantization='nvfp4' but the checkpoint is mxfp4"):
            LLM(str(qdir), quantization="nvfp4", dtype="float32")
    finally:
        mp.undo()


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_packed_fp4_engine_on_cuda_runs_the_fp4_gemv(tmp_path, fmt):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from tests.gpu_kernels import require_fused_kernels

    require_fused_kernels()
    from onecat.engine import LLM, SamplingParams

    qdir = fp4_dir(tmp_path, fmt)
    params = SamplingParams(temperature=0.0, max_tokens=8, prompt_logprobs=0)
    from tests.quant_checkpoints import PROMPTS

    with LLM(str(qdir), dtype="float16", quantization=fmt, max_model_len=64) as llm:
        assert sum(isinstance(m, FP4Linear) for m in llm.model.modules()) == 7
        packed = llm.generate(PROMPTS, params)
    with LLM(str(qdir), dtype="float16", max_model_len=64) as llm:
        dense = llm.generate(PROMPTS, params)
    for a, b in zip(packed, dense):  # fp16 activations: GEMV (fp32 sums) vs cuBLAS on the same fp16 weights
        assert torch.allclose(torch.tensor(a.prompt_logprobs[1:]), torch.tensor(b.prompt_logprobs[1:]), atol=2e-2)
