"""The FP4 GEMV (NVFP4, MXFP4) on CUDA against a float64 reference on the exactly dequantized weight, held
to the W4A16 GEMV's bound (tests/test_w4a16_gpu.py): exact products, fp32 sums, one rounding of the output.
Also the split-K tiles, the dense path above 8 rows and CUDA-graph replay."""
from __future__ import annotations

import pytest
import torch

from onecat.engine.quant.fp4.layout import dequantize, from_mxfp4, from_nvfp4
from onecat.engine.quant.fp4.linear import FP4Linear, fp4_gemv
from tests.gpu_kernels import require_fused_kernels
from tests.test_fp4_packed import mxfp4_parts, nvfp4_parts
from tests.test_w4a16_gpu import check_bound


@pytest.fixture(autouse=True)
def _cuda():
    require_fused_kernels()


def packed(fmt: str, n: int, k: int, seed: int):
    if fmt == "nvfp4":
        p = nvfp4_parts(n, k, seed)
        return from_nvfp4(p["weight"], p["weight_scale"], p["weight_scale_2"])
    p = mxfp4_parts(n, k, seed)
    return from_mxfp4(p["weight_blocks"], p["weight_scales"])


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n,k", [(4096, 4096), (200, 1536), (72, 14336), (1000, 256)])
def test_fp4_gemv_matches_the_float64_reference(fmt, dtype, n, k):
    w = packed(fmt, n, k, n + k)
    dense = dequantize(w)
    layer = FP4Linear(w.to("cuda"))
    gen = torch.Generator().manual_seed(k)
    for m in (1, 2, 3, 8):
        x = (torch.randn(m, k, generator=gen) * 0.05).to("cuda", dtype)
        check_bound(layer(x), x, dense)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_split_and_tensor_core_tiles_agree_with_the_bound(fmt, dtype):
    """FMA tiles with split K at 1 and 3 rows; the tensor-core path (SM80+) at 2 and 8 rows; same bits on
    every call."""
    w = packed(fmt, 384, 4096, 9).to("cuda")
    gen = torch.Generator().manual_seed(9)
    configs = [(1, (16, 128, 2, 1)), (1, (16, 128, 2, 4)), (3, (8, 256, 2, 2)), (1, (16, 512, 8, 1))]
    if torch.cuda.get_device_capability()[0] >= 8:
        configs += [(2, ("dot", 16, 4, 3, 1)), (8, ("dot", 32, 4, 3, 2)), (8, ("dot", 64, 4, 3, 1))]
    for m, config in configs:
        x = (torch.randn(m, 4096, generator=gen) * 0.05).to("cuda", dtype)
        y = fp4_gemv(x, w, config)
        check_bound(y, x, dequantize(w))
        assert torch.equal(y, fp4_gemv(x, w, config))


def test_more_rows_take_the_dense_gemm_and_graphs_replay():
    w = packed("nvfp4", 300, 512, 5).to("cuda")
    layer = FP4Linear(w)
    x = (torch.randn(2, 16, 512) * 0.05).to("cuda", torch.float16)
    check_bound(layer(x), x, dequantize(w), dense_path=True)
    x1 = x[0, :1].contiguous()
    first = layer(x1)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = layer(x1)
    g.replay()
    assert torch.equal(out, first)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("n,k", [(4096, 4096), (77, 1536)])
def test_dequant_kernel_gives_the_reference_bits_and_prefill_uses_it(fmt, n, k):
    """The Triton dequantizer (what a prefill's GEMM runs on) gives dense_on_device's bits in every dtype; a
    20-row call of FP4Linear is the library GEMM on that weight."""
    from onecat.engine.kernels import triton_fp4 as kf
    from onecat.engine.quant.fp4.linear import FMT_IDS, FP4Linear, dense_on_device
    from onecat.engine.quant.fp4.slots import to_slots

    w = packed(fmt, n, k, n + k).to("cuda")
    g = w.gscale if w.gscale is not None else w.scales
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        ref = dense_on_device(w, dtype)
        got = kf.dequantize(w.qweight, w.scales, g, FMT_IDS[fmt], dtype)
        assert torch.equal(got.nan_to_num(), ref.nan_to_num()) and torch.equal(got.isnan(), ref.isnan()), dtype
        for slots in (torch.float16, torch.bfloat16):  # the codes in slots (fp4/slots.py)
            got = kf.dequantize(to_slots(w.qweight, slots, fmt), w.scales, g, FMT_IDS[fmt], dtype, slots=slots)
            assert torch.equal(got.nan_to_num(), ref.nan_to_num()), (dtype, slots)
    layer = FP4Linear(w)
    x = torch.randn(20, k, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(layer(x), torch.nn.functional.linear(x, dense_on_device(w, torch.bfloat16)))
