"""quantization='w4a16' in the engine: a 4-bit checkpoint's linears are kept packed (fused q/k/v and gate/up
stacked), a dense checkpoint is quantized at load, and the refusals say what to use. The CPU tests run the
same loading code with the CUDA layer, W4A16Linear, which computes on the exactly dequantized weight there,
so the packed engine must give the dequantized engine's logprobs."""
from __future__ import annotations

import pytest
import torch

from onecat.engine.errors import ConfigError
from onecat.engine.quant.w4a16.layout import dequantize, quantize_w4
from onecat.engine.quant.hf_packer import W4A16Packer, check_w4a16
from tests.quant_checkpoints import LINEARS, PROMPTS, dense_dir, linear_modules, quantized_dir, tiny_llama

pytest.importorskip("transformers")  # the tiny checkpoints are written by transformers


def gptq_dir(tmp_path, act_order: bool):
    from tests.test_quant_formats_gptq import config, gptq_quantize

    src, state = tiny_llama(tmp_path / "src")
    stored = {m: gptq_quantize(state[f"{m}.weight"], 4, False, act_order, False, seed=i)[0]
              for i, m in enumerate(linear_modules(state))}
    return quantized_dir(src, tmp_path / "gptq", stored, config(4, False, act_order))


def prompt_logprobs(path, **settings) -> tuple[list[torch.Tensor], dict]:
    from onecat.engine import LLM, SamplingParams

    with LLM(str(path), dtype="float32", enable_prefix_caching=False, max_model_len=64, **settings) as llm:
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0))
        info = llm.info()["quantization"]
    return [torch.tensor(o.prompt_logprobs[1:]) for o in outs], info


@pytest.fixture
def on_cpu(monkeypatch):
    """The CUDA layers on CPU: W4A16Linear computes on the exactly dequantized weight, so the loading logic
    is checked to 1e-5 (CPU's own int4 kernel rounds scales to bf16: tests/test_w4a16_cpu.py)."""
    import onecat.engine.quant.hf_packer as packer

    monkeypatch.setattr(packer, "CPU_INT4_KERNEL", False)


def test_refused_off_cuda_and_format_names_need_hf():
    with pytest.raises(ConfigError, match="CUDA 4-bit GEMV kernels"):
        check_w4a16("nvfp4", "hf", torch.device("cpu"))  # FP4 has no CPU kernel; the 4-bit W4A16 formats do
    check_w4a16("w4a16", "hf", torch.device("cpu"))
    with pytest.raises(ConfigError, match="reads a awq HF checkpoint"):
        check_w4a16("awq", "gguf", torch.device("cuda"))
    check_w4a16("w4a16", "gguf", torch.device("cuda"))  # a GGUF file's tensors are quantized at load


@pytest.mark.parametrize("act_order", [False, True])
def test_packed_gptq_engine_gives_the_dequantized_logprobs(tmp_path, on_cpu, act_order):
    qdir = gptq_dir(tmp_path, act_order)
    packed, info = prompt_logprobs(qdir, quantization="gptq")
    dense, _ = prompt_logprobs(qdir)
    for a, b in zip(packed, dense):
        assert torch.allclose(a, b, rtol=0, atol=1e-5)
    assert info["method"] == "w4a16" and info["source"].startswith("checkpoint gptq")
    # per layer qkv, o, gate_up, down, less layer 1's down (stored dense); act-order: the shards of q/k/v and
    # of gate/up carry different input permutations, so those fused linears stay dense
    fused = [f"layers.{i}.{m}" for i in range(2) for m in ("self_attn.qkv_proj", "mlp.gate_up_proj")]
    assert info["packed_linears"] == (3 if act_order else 7)
    assert sorted(info["kept_dense"]) == (sorted(fused) if act_order else [])


def test_format_name_must_match_the_checkpoint(tmp_path, on_cpu):
    from onecat.engine import LLM

    with pytest.raises(ConfigError, match="the checkpoint is gptq"):
        LLM(str(gptq_dir(tmp_path, False)), quantization="awq", dtype="float32")
    src, _ = tiny_llama(tmp_path / "dense")
    with pytest.raises(ConfigError, match="needs a awq checkpoint"):
        LLM(str(src), quantization="awq", dtype="float32")


def test_dense_checkpoint_is_quantized_at_load(tmp_path, on_cpu):
    src, state = tiny_llama(tmp_path / "src", hidden_size=128, intermediate_size=256)
    rtn = {f"model.layers.{i}.{n}": dequantize(quantize_w4(state[f"model.layers.{i}.{n}.weight"], 128))
           for i in range(2) for n in LINEARS}  # every decoder linear, KEPT_DENSE too
    packed, info = prompt_logprobs(src, quantization="w4a16")
    reference, _ = prompt_logprobs(dense_dir(src, tmp_path / "rtn", rtn))
    for a, b in zip(packed, reference):
        assert torch.allclose(a, b, rtol=0, atol=1e-5)
    assert info["packed_linears"] == 8 and info["source"] == "round-to-nearest w4 g128 at load"
    assert "lm_head" in info["dense_linears"]


@pytest.mark.gpu
def test_packed_engine_on_cuda_runs_the_w4a16_kernels(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from tests.gpu_kernels import require_fused_kernels

    require_fused_kernels()
    from onecat.engine import LLM, SamplingParams
    from onecat.engine.quant.w4a16.linear import W4A16Linear

    from safetensors.torch import load_file

    src, _ = tiny_llama(tmp_path / "src", hidden_size=128, intermediate_size=256)
    params = SamplingParams(temperature=0.0, max_tokens=8, prompt_logprobs=0)
    with LLM(str(src), dtype="float16", quantization="w4a16", max_model_len=64) as llm:
        assert sum(isinstance(m, W4A16Linear) for m in llm.model.modules()) == 8
        packed = llm.generate(PROMPTS, params)
    state = load_file(str(src / "model.safetensors"))
    rtn = {f"model.layers.{i}.{n}": dequantize(quantize_w4(state[f"model.layers.{i}.{n}.weight"], 128))
           for i in range(2) for n in LINEARS}
    with LLM(str(dense_dir(src, tmp_path / "rtn", rtn)), dtype="float16", max_model_len=64) as llm:
        dense = llm.generate(PROMPTS, params)
    for a, b in zip(packed, dense):  # fp16 activations: GEMV (fp32 sums) vs cuBLAS on the same weights
        assert torch.allclose(torch.tensor(a.prompt_logprobs[1:]), torch.tensor(b.prompt_logprobs[1:]), atol=2e-2)
