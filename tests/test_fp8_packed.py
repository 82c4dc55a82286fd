"""quantization='fp8': FP8 E4M3 checkpoints written by the compressed-tensors library keep their linears
packed (engine/quant/fp8/layout.py, fp8/linear.py). The layout holds the checkpoint's values exactly; the
engine with packed layers gives the dequantized engine's logprobs (on CPU the layer computes on the exactly
dequantized weight, so the loading logic is checked to 1e-5; on CUDA the packed GEMV runs); block-scaled
layers stay dense; CPU and non-FP8 checkpoints are refused with what to use."""
from __future__ import annotations

import pytest
import torch

from onecat.engine.errors import ConfigError
from onecat.engine.quant.fp8.layout import dequantize, pack_fp8
from onecat.engine.quant.fp8.linear import FP8Linear
from tests.quant_checkpoints import PROMPTS, dense_dir, linear_modules, onecat_weights, quantized_dir, tiny_llama

pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")


def test_layout_holds_the_values_and_scales_exactly():
    gen = torch.Generator().manual_seed(0)
    raw = (torch.randn(24, 64, generator=gen) * 30).to(torch.float8_e4m3fn)
    for scale in (torch.tensor(0.02), torch.rand(24, 1, generator=gen) + 0.1):
        w = pack_fp8(raw, scale)
        assert w.qweight.shape == (24, 16) and w.scale.shape == (24,)
        assert torch.equal(dequantize(w), raw.float() * scale.float().reshape(-1, 1).expand(24, 1))
    with pytest.raises(ValueError, match="multiple of 16"):
        pack_fp8(raw[:, :40], torch.tensor(1.0))
    with pytest.raises(ValueError, match="one per tensor or per row"):
        pack_fp8(raw, torch.ones(3))


def test_dense_weight_is_the_dequantized_weight_rounded_once(monkeypatch):
    """The dense path's weight (more rows than the GEMV takes), formed in row blocks from byte views: the float32
    dequantization rounded once to each dtype, subnormal codes and 448 included."""
    import onecat.engine.quant.fp8.linear as fp8_linear

    gen = torch.Generator().manual_seed(4)
    raw = (torch.randn(40, 64, generator=gen) * 40).to(torch.float8_e4m3fn)
    raw.view(torch.uint8)[0, :4] = torch.tensor([1, 0x81, 7, 0x7E], dtype=torch.uint8)
    w = pack_fp8(raw, torch.rand(40, generator=gen) * 0.01 + 1e-3)
    monkeypatch.setattr(fp8_linear, "DENSE_ROWS", 16)  # three blocks, the last one short
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        assert torch.equal(FP8Linear(w).dense_weight(dtype), dequantize(w).to(dtype))


@pytest.mark.gpu
def test_dense_weight_on_cuda_is_one_triton_pass_with_the_same_bits():
    """On CUDA the dense path's weight comes from engine/kernels/triton_fp8.py, from row-major and from tiled words:
    the float32 dequantization rounded once to fp16, bf16 and float32."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    gen = torch.Generator().manual_seed(6)
    raw = (torch.randn(96, 1024, generator=gen) * 40).to(torch.float8_e4m3fn)
    raw.view(torch.uint8)[0, :4] = torch.tensor([1, 0x81, 7, 0x7E], dtype=torch.uint8)
    w = pack_fp8(raw, torch.rand(96, generator=gen) * 0.01 + 1e-3)
    want = dequantize(w)
    layer = FP8Linear(w.to("cuda"))
    for act in (None, torch.float16):  # row-major words, then the tensor-core GEMV's tiles where it is built
        if act is not None:
            layer.use_tiles(act)
        for dtype in (torch.float16, torch.bfloat16, torch.float32):
            assert torch.equal(layer.dense_weight(dtype).cpu(), want.to(dtype)), (act, dtype)


def test_layer_on_cpu_is_the_dequantized_linear():
    raw = (torch.randn(40, 96) * 10).to(torch.float8_e4m3fn)
    w = pack_fp8(raw, torch.rand(40) * 0.1)
    bias = torch.randn(40)
    x = torch.randn(3, 96)
    layer = FP8Linear(w, bias)
    assert torch.allclose(layer(x), x @ dequantize(w).t() + bias, atol=1e-5)
    with pytest.raises(ValueError, match="takes 96 input features"):
        layer(torch.randn(2, 95))


def fp8_dir(tmp_path, case: str):
    from compressed_tensors.quantization import QuantizationArgs

    from tests.test_quant_formats_compressed_tensors import CASES, compress

    src, state = tiny_llama(tmp_path / "src")
    fmt, kw, scale_dtype = CASES[case]
    stored, _, config = compress(state, fmt, QuantizationArgs(**kw), scale_dtype)
    return src, state, quantized_dir(src, tmp_path / case, stored, config)


@pytest.fixture
def fp8_on_cpu(monkeypatch):
    """Lets the engine build FP8Linear on CPU (its reference path), as the W4A16 engine tests do."""
    import onecat.engine.quant.hf_packer as packer

    monkeypatch.setattr(packer, "NO_CPU_KERNEL", tuple(n for n in packer.NO_CPU_KERNEL if n != "fp8"))


@pytest.mark.parametrize("case", ["fp8-tensor", "fp8-channel"])
def test_packed_engine_gives_the_dequantized_logprobs(tmp_path, fp8_on_cpu, case):
    from tests.test_w4a16_engine import prompt_logprobs

    _, _, qdir = fp8_dir(tmp_path, case)
    packed, info = prompt_logprobs(qdir, quantization="fp8")
    dense, _ = prompt_logprobs(qdir)
    for a, b in zip(packed, dense):
        assert torch.allclose(a, b, rtol=0, atol=1e-5)
    assert info["method"] == "fp8" and "compressed-tensors" in info["source"]
    assert info["packed_linears"] == 7 and info["kept_dense"] == []  # layer 1's down_proj is stored dense


def test_block_scaled_layers_stay_dense(tmp_path, fp8_on_cpu):
    from onecat.engine import LLM

    _, _, qdir = fp8_dir(tmp_path, "fp8-block")
    with pytest.raises(ConfigError, match="per-tensor or per-channel"):
        LLM(str(qdir), quantization="fp8", dtype="float32")


def test_refusals_name_what_to_use(tmp_path):
    from onecat.engine import LLM
    from onecat.engine.quant.hf_packer import check_w4a16

    with pytest.raises(ConfigError, match="leave quantization unset"):
        check_w4a16("fp8", "hf", torch.device("cpu"))
    from tests.test_w4a16_engine import gptq_dir

    import onecat.engine.quant.hf_packer as packer

    saved = packer.NO_CPU_KERNEL
    packer.NO_CPU_KERNEL = ()
    try:
        with pytest.raises(ConfigError, match="reads FP8 E4M3 checkpoints"):
            LLM(str(gptq_dir(tmp_path, False)), quantization="fp8", dtype="float32")
    finally:
        packer.NO_CPU_KERNEL = saved


@pytest.mark.gpu
def test_packed_engine_on_cuda_runs_the_packed_gemv(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from onecat.engine import LLM, SamplingParams
    from onecat.engine.kernels.quant_gemv import backend

    if backend()[0] != "cuda":
        pytest.skip(backend()[1])
    src, state, qdir = fp8_dir(tmp_path, "fp8-channel")
    got = onecat_weights(qdir)
    exact = {m: got[f"{m}.weight"] for m in linear_modules(state)}
    params = SamplingParams(temperature=0.0, max_tokens=8, prompt_logprobs=0)
    with LLM(str(qdir), dtype="float16", quantization="fp8", max_model_len=64) as llm:
        assert sum(isinstance(m, FP8Linear) for m in llm.model.modules()) == 7
        packed = llm.generate(PROMPTS, params)
    with LLM(str(dense_dir(src, tmp_path / "dense", exact)), dtype="float16", max_model_len=64) as llm:
        dense = llm.generate(PROMPTS, params)
    for a, b in zip(packed, dense):  # fp16 activations: GEMV (fp32 sums) vs cuBLAS on the same weights
        assert torch.allclose(torch.tensor(a.prompt_logprobs[1:]), torch.tensor(b.prompt_logprobs[1:]), atol=2e-2)


def test_tensor_core_pair_decode_is_exact_for_every_code():
    """csrc/quant_gemv/fp8_mma.cuh fp8_pair, step by step on all 256 codes: the byte permute puts a code in the high
    byte of a 16-bit half; one shift and the masks give the fp16 bits of e4m3 * 2^-8, or the bf16 bits of
    e4m3 * 2^-120 (times 2^112 after), exactly, subnormals included (0x7F and 0xFF, NaN in E4M3, are never
    written by pack_fp8's checkpoints and are left out)."""
    codes = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.int64)
    value = codes.to(torch.uint8).view(torch.float8_e4m3fn).double()
    half = codes << 8  # the code in the high byte of its half (the low byte is masked off)
    fp16 = (half & 0x8000) | ((half >> 1) & 0x3F80)
    got = fp16.to(torch.int16).view(torch.float16).double()
    assert torch.equal(got, value * 2.0 ** -8)
    bf16 = (half & 0x8000) | ((half >> 4) & 0x07F0)
    got = bf16.to(torch.int16).view(torch.bfloat16).double()
    assert torch.equal(got, value * 2.0 ** -120)
