"""The W4A16 kernels on CUDA against a float64 reference on the exactly dequantized weight.

The GEMV is held to the bound of its arithmetic: every product (q - z) * x and the group scale are exact
or rounded once in fp32, sums run in fp32, the output is rounded once. So
    |y - ref| <= u * |ref| + K * 2^-23 * sum_k |w_k x_k|
with u the unit roundoff of the output dtype (2^-11 fp16, 2^-8 bf16) and K * 2^-23 twice the classic
fp32 summation bound. The dense path (more than 8 rows) rounds the weight to the activation dtype before
the library GEMM, which adds u * sum_k |w_k x_k|. Each checkpoint converter's layer is checked the same way
against the formats' dequantized weight."""
from __future__ import annotations

import pytest
import torch

from onecat.engine.quant.w4a16.packing import convert
from onecat.engine.quant.w4a16.layout import dequantize, quantize_w4
from onecat.engine.quant.w4a16.linear import W4A16Linear
from tests.gpu_kernels import require_fused_kernels

UNIT = {torch.float16: 2**-11, torch.bfloat16: 2**-8}


@pytest.fixture(autouse=True)
def _cuda():
    require_fused_kernels()


def check_bound(y: torch.Tensor, x: torch.Tensor, dense: torch.Tensor, dense_path: bool = False) -> None:
    xd, wd = x.double().reshape(-1, x.shape[-1]), dense.double().to(x.device)
    ref = xd @ wd.t()
    mag = xd.abs() @ wd.abs().t()
    u = UNIT[x.dtype]
    bound = u * ref.abs() + (x.shape[-1] * 2**-23 + (u if dense_path else 0)) * mag + 1e-6
    err = (y.double().reshape(ref.shape) - ref).abs()
    assert bool((err <= bound).all()), f"max err {float(err.max())}, worst err/bound {float((err / bound).max())}"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n,k,group", [(4096, 4096, 128), (200, 1536, 32), (72, 14336, 64), (1000, 256, 128)])
def test_gemv_matches_the_float64_reference(dtype, n, k, group):
    gen = torch.Generator().manual_seed(n + k)
    weight = torch.randn(n, k, generator=gen) * k ** -0.5
    packed = quantize_w4(weight, group).to("cuda")
    layer = W4A16Linear(packed)
    dense = dequantize(packed)
    for m in (1, 2, 3, 8):
        x = torch.randn(m, k, generator=gen).to("cuda", dtype)
        check_bound(layer(x), x, dense)


@pytest.mark.parametrize("config", [(16, 128, 2, 2), (16, 128, 2, 4), (16, 512, 8, 1), ("dot", 16, 4, 3, 1),
                                    ("dot", 32, 4, 3, 4), ("dot", 64, 4, 3, 2)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_split_k_and_tensor_core_tiles_match_the_reference(config, dtype):
    """Split-K (fp32 partials summed in a fixed order) and the tl.dot path (SM80+) keep the GEMV's bound,
    and give the same bits on every call."""
    from onecat.engine.kernels.triton_w4a16 import w4a16_gemv

    if config[0] == "dot" and torch.cuda.get_device_capability()[0] < 8:
        pytest.skip("tl.dot path needs SM80+")
    gen = torch.Generator().manual_seed(3)
    packed = quantize_w4(torch.randn(384, 4096, generator=gen) * 0.02, 128).to("cuda")
    layer = W4A16Linear(packed)
    for m in ((1, 3) if config[0] != "dot" else (2, 8)):
        x = torch.randn(m, 4096, generator=gen).to("cuda", dtype)
        y = w4a16_gemv(x, packed.qweight, layer.scale_zero, 128, config=config)
        check_bound(y, x, dequantize(packed))
        assert torch.equal(y, w4a16_gemv(x, packed.qweight, layer.scale_zero, 128, config=config))


@pytest.mark.parametrize("tile", [0, 96])
def test_more_rows_take_the_dense_gemm(tile):
    weight = torch.randn(300, 512, generator=torch.Generator().manual_seed(5)) * 0.05
    packed = quantize_w4(weight, 128).to("cuda")
    bias = torch.randn(300).to("cuda", torch.float16)
    layer = W4A16Linear(packed, bias, dense_tile_rows=tile)
    x = torch.randn(2, 16, 512).to("cuda", torch.float16)
    y = layer(x) - bias
    assert y.shape == (2, 16, 300)
    check_bound(y, x, dequantize(packed), dense_path=True)


def test_dequant_kernel_rounds_the_exact_weight_once():
    from onecat.engine.kernels.triton_w4a16 import w4a16_dequant

    packed = quantize_w4(torch.randn(130, 384) * 0.1, 32).to("cuda")
    for dtype in (torch.float16, torch.bfloat16):
        w = w4a16_dequant(packed.qweight, packed.scales, packed.zeros, packed.group, dtype)
        assert torch.equal(w.cpu(), dequantize(packed).cpu().to(dtype))


def test_gemv_under_cuda_graph_replays_the_same_result():
    packed = quantize_w4(torch.randn(512, 1024) * 0.03, 128).to("cuda")
    layer = W4A16Linear(packed)
    x = torch.randn(1, 1024, device="cuda", dtype=torch.float16)
    first = layer(x)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = layer(x)
    g.replay()
    assert torch.equal(out, first)


@pytest.mark.parametrize("case", ["awq", "gptq-sym", "gptq-act-order", "gptq-v2", "ct-sym", "ct-asym", "ct-channel",
                                  "ct-g_idx"])
def test_each_converter_matches_the_dequantizing_loader(case):
    pytest.importorskip("transformers")  # the AWQ / GPTQ writers live in test modules that need it
    from tests.w4a16_checkpoints import MODULE, stored_linear

    weight = torch.randn(96, 256, generator=torch.Generator().manual_seed(7)) * 0.05
    fmt, stored = stored_linear(case, weight, seed=11)
    reference = fmt.dequantize(MODULE, dict(stored))
    layer = W4A16Linear(convert(fmt, MODULE, stored).to("cuda"))
    for m in (1, 5, 8):
        x = torch.randn(m, 256).to("cuda", torch.float16)
        check_bound(layer(x), x, reference)
