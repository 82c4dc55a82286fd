"""The packed many-row GEMM (engine/kernels/triton_packed_rows.py) on a GPU (skipped without CUDA, Triton or
SM80): against the dequantized weight's product for NVFP4, MXFP4 and W4A16, fp16 and bf16, 17-128 rows and odd
N; which calls FP4Linear, W4A16Linear and FP8Linear send to it when ONECAT_PACKED_ROWS_GEMM is on (17-128 rows,
the words as the layer keeps them for the tensor-core GEMV: tiles, code slots; 16 rows to the packed GEMV, 129
to the dense path) and by default (each format's rows from the H100 timing); and a CUDA-graph replay of it equal
to the eager call."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from tests.gpu_kernels import half_tolerance, require_fused_kernels
from tests.test_fp4_gpu import packed

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(autouse=True)
def _sm80():
    from onecat.engine.kernels.device import capability
    from onecat.engine.kernels.triton_support import PACKED_ROWS_MIN_CAPABILITY

    require_fused_kernels()
    if capability(0) < PACKED_ROWS_MIN_CAPABILITY:
        pytest.skip(f"the packed many-row GEMM needs SM{PACKED_ROWS_MIN_CAPABILITY}+")


def _close(y, ref, dtype):
    err = float((y.float() - ref.float()).abs().max() / ref.float().abs().max())
    assert err < half_tolerance(dtype), err


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n,k,rows", [(5120, 5120, 128), (6144, 4096, 17), (1000, 1536, 40), (96, 17408, 64)])
def test_fp4_rows_gemm_matches_the_dequantized_product(fmt, dtype, n, k, rows):
    from onecat.engine.kernels.triton_fp4 import dequantize
    from onecat.engine.kernels.triton_packed_rows import fp4_rows_gemm
    from onecat.engine.quant.fp4.linear import FMT_IDS

    w = packed(fmt, n, k, n + k).to("cuda")
    gscale = w.gscale if w.gscale is not None else torch.ones(n, device="cuda")
    x = torch.randn(rows, k, device="cuda", dtype=dtype)
    dense = dequantize(w.qweight, w.scales, gscale, FMT_IDS[fmt], dtype)
    y = fp4_rows_gemm(x, w.qweight, w.scales, gscale, FMT_IDS[fmt])
    assert y.shape == (rows, n) and y.dtype == dtype
    _close(y, F.linear(x.float(), dense.float()), dtype)


def _layer(fmt: str, n: int, k: int):
    """(packed CUDA layer of a random [n, k] weight in fmt, its dequantized float32 weight)."""
    from onecat.engine.quant.fp4.layout import dequantize as fp4_dequantize
    from onecat.engine.quant.fp4.linear import FP4Linear
    from onecat.engine.quant.fp8 import layout as fp8_layout
    from onecat.engine.quant.fp8.linear import FP8Linear
    from onecat.engine.quant.w4a16.layout import dequantize as w4_dequantize
    from onecat.engine.quant.w4a16.layout import quantize_w4
    from onecat.engine.quant.w4a16.linear import W4A16Linear
    if fmt == "w4a16":
        layer = W4A16Linear(quantize_w4(torch.randn(n, k) * 0.05, 128).to("cuda"))
        dense = w4_dequantize(layer.packed())
    elif fmt == "fp8":
        layer = FP8Linear(fp8_layout.pack_fp8((torch.randn(n, k) * 40).to(torch.float8_e4m3fn),
                                              torch.rand(n) * 1e-3 + 1e-4).to("cuda"))
        dense = fp8_layout.dequantize(layer.packed())
    else:
        layer = FP4Linear(packed(fmt, n, k, 7).to("cuda"))
        dense = fp4_dequantize(layer.packed())
    return layer, dense


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "w4a16", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_packed_linears_send_17_to_128_rows_to_it_in_their_kept_layout(fmt, dtype, monkeypatch):
    """Switched on for every format (ONECAT_PACKED_ROWS_GEMM=1) with the GEMV held to 16 rows: 17-128 rows go to
    the many-row GEMM, tiled and row-major layers alike."""
    from onecat.engine.kernels import quant_gemv, triton_packed_rows, triton_support

    n, k = 1024, 2048
    layer, dense = _layer(fmt, n, k)
    rows_major = copy.deepcopy(layer)
    layer.use_tiles(dtype)
    calls = []
    entry = {"w4a16": "w4a16_rows_gemm", "fp8": "fp8_rows_gemm"}.get(fmt, "fp4_rows_gemm")
    real = getattr(triton_packed_rows, entry)
    monkeypatch.setattr(triton_packed_rows, entry, lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw))
    monkeypatch.setattr(triton_support, "PACKED_ROWS_GEMM", True)
    monkeypatch.setattr(quant_gemv, "BLOCKED_ROWS_BY_FORMAT",
                        {per_call: dict.fromkeys(t, 16) for per_call, t in quant_gemv.BLOCKED_ROWS_BY_FORMAT.items()})
    for rows in (16, 17, 100, 128, 129):
        x = torch.randn(rows, k, device="cuda", dtype=dtype)
        ref = F.linear(x.float(), dense.to(dtype).float())
        _close(layer(x), ref, dtype)
        _close(rows_major(x), ref, dtype)
    assert calls == [17, 17, 100, 100, 128, 128], calls  # tiled (if kept) and row-major layers alike


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "w4a16", "fp8"])
def test_by_default_each_format_sends_the_rows_its_timing_chose(fmt, monkeypatch):
    """Unswitched: up to quant_gemv.blocked_rows the GEMV in calls of 16 rows (64 rows for the 4-bit formats, 16 for
    FP8), then the many-row GEMM up to triton_support.PACKED_ROWS_UP_TO (FP4 128, W4A16 64: none past the GEMV's,
    FP8 none), then the dequantized weight; every path's product close to the dense one."""
    from onecat.engine.kernels import quant_gemv, triton_packed_rows, triton_support

    monkeypatch.setattr(triton_support, "PACKED_ROWS_GEMM", None)
    n, k = 1024, 2048
    dtype = torch.float16 if fmt == "w4a16" else torch.bfloat16  # each format's tensor-core GEMV takes these
    layer, dense = _layer(fmt, n, k)
    calls, blocked = [], []
    entry = {"w4a16": "w4a16_rows_gemm", "fp8": "fp8_rows_gemm"}.get(fmt, "fp4_rows_gemm")
    real, real_blocks = getattr(triton_packed_rows, entry), quant_gemv.packed_gemv_blocks
    monkeypatch.setattr(triton_packed_rows, entry, lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw))
    monkeypatch.setattr(quant_gemv, "packed_gemv_blocks",
                        lambda x, *a, **kw: blocked.append(x.numel() // k) or real_blocks(x, *a, **kw))
    rows = (16, 17, 32, 33, 64, 65, 128, 129)
    for m in rows:
        x = torch.randn(m, k, device="cuda", dtype=dtype)
        _close(layer(x), F.linear(x.float(), dense.to(dtype).float()), dtype)
    words = {"w4a16": "int4"}.get(fmt, fmt)
    per_call = quant_gemv.MMA_MAX_ROWS if quant_gemv.MMA_16_ROWS else quant_gemv.MAX_ROWS
    gemv_rows = quant_gemv.blocked_rows(words, per_call)
    assert blocked == [m for m in rows if m <= gemv_rows], blocked
    assert calls == [m for m in rows if gemv_rows < m <= triton_support.PACKED_ROWS_UP_TO.get(words, 0)], calls


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("group,n,k,rows", [(128, 5120, 5120, 128), (64, 1000, 1536, 40), (32, 96, 4096, 17)])
def test_w4a16_rows_gemm_matches_the_dequantized_product(dtype, group, n, k, rows):
    from onecat.engine.kernels.triton_packed_rows import w4a16_rows_gemm
    from onecat.engine.quant.w4a16.layout import dequantize, quantize_w4

    w = quantize_w4(torch.randn(n, k) * k ** -0.5, group).to("cuda")
    x = torch.randn(rows, k, device="cuda", dtype=dtype)
    y = w4a16_rows_gemm(x, w.qweight, w.scales, w.zeros, group)
    assert y.shape == (rows, n) and y.dtype == dtype
    _close(y, F.linear(x.float(), dequantize(w).to(dtype).float()), dtype)


def test_fp4_rows_gemm_replays_in_a_cuda_graph():
    from onecat.engine.kernels.triton_packed_rows import fp4_rows_gemm

    w = packed("nvfp4", 2048, 1024, 5).to("cuda")
    x = torch.randn(48, 1024, device="cuda", dtype=torch.bfloat16)
    eager = fp4_rows_gemm(x, w.qweight, w.scales, w.gscale, 0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fp4_rows_gemm(x, w.qweight, w.scales, w.gscale, 0)
    x.copy_(torch.randn_like(x))
    graph.replay()
    assert torch.equal(out, fp4_rows_gemm(x, w.qweight, w.scales, w.gscale, 0))
    assert not torch.equal(out, eager)
