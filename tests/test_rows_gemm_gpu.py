"""The few-row GEMM (engine/kernels/triton_rows_gemm.py) on a GPU (skipped without CUDA + Triton): against
torch for the 8B projections' shapes and odd ones, both half dtypes, bias, both operand orders, the folded
SiLU*mul against the separate kernel, and which calls Linear and norm_then_linear send to it when it is on
(ONECAT_ROWS_GEMM=1: 2-32 rows with the fused kernels on; one row to the GEMV; more rows, or the switch off, to
the library GEMM)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from gpu_kernels import half_tolerance, require_fused_kernels

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _rg():
    from onecat.engine.kernels import triton_rows_gemm

    require_fused_kernels()
    return triton_rows_gemm


def _close(y, ref, dtype):
    err = float((y.float() - ref.float()).abs().max() / ref.float().abs().max())
    assert err < half_tolerance(dtype), err


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n,k,bias,rows", [(6144, 4096, False, 8), (4096, 14336, False, 16), (1000, 576, True, 2),
                                           (130, 4096, True, 32), (49152, 960, False, 5)])
def test_rows_gemm_matches_linear(dtype, n, k, bias, rows):
    rg = _rg()
    w = torch.randn(n, k, device="cuda", dtype=dtype) * k ** -0.5
    b = torch.randn(n, device="cuda", dtype=dtype) if bias else None
    x = torch.randn(rows, k, device="cuda", dtype=dtype)
    assert rg.rows_gemm_unsupported_reason(x, w) is None
    y = rg.rows_gemm(x, w, b)
    assert y.shape == (rows, n) and y.dtype == dtype
    _close(y, F.linear(x.float(), w.float(), None if b is None else b.float()), dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("swap", [False, True])
@pytest.mark.parametrize("rows", [3, 16, 24])
def test_glu_matches_the_separate_kernel(dtype, swap, rows):
    from onecat.engine.kernels import triton_fused as tf

    rg = _rg()
    n, k = 2 * 1408, 2048
    w = torch.randn(n, k, device="cuda", dtype=dtype) * k ** -0.5
    x = torch.randn(rows, k, device="cuda", dtype=dtype)
    ref = tf.silu_mul(F.linear(x, w))
    m, bn, bk, st, wp, _ = rg.default_config(rows, n // 2, k, True)
    y = rg.rows_gemm(x, w, glu=True, config=(m, bn, bk, st, wp, swap))
    assert y.shape == (rows, n // 2)
    _close(y, ref, dtype)


def test_linear_routes_two_to_32_rows(monkeypatch):
    from onecat.engine.kernels import triton_rows_gemm as rg
    from onecat.engine.layers import linear as linear_mod
    from onecat.engine.layers.linear import Linear, norm_then_linear
    from onecat.engine.layers.norm import RMSNorm

    _rg()
    monkeypatch.setattr(linear_mod, "ROWS_GEMM", True)
    calls = []
    real = rg.rows_gemm
    monkeypatch.setattr(rg, "rows_gemm", lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw))
    lin = Linear(256, 320, bias=True).to("cuda", torch.float16)
    x = {m: torch.randn(m, 256, device="cuda", dtype=torch.float16) for m in (1, 2, 32, 33)}
    lin(x[2])
    assert calls == []  # fused kernels off
    lin.use_fused = True
    for m in (1, 2, 32, 33):
        _close(lin(x[m]), F.linear(x[m].float(), lin.weight.float(), lin.bias.float()), torch.float16)
    assert calls == [2, 32]
    norm = RMSNorm(256, 1e-5).to("cuda", torch.float16)
    ref_x, ref_h = norm(x[32], x[32])
    y, h = norm_then_linear(norm, lin, x[32], x[32])
    assert calls[-1] == 32 and torch.equal(h, ref_h)
    _close(y, F.linear(ref_x.float(), lin.weight.float(), lin.bias.float()), torch.float16)
    monkeypatch.setattr(linear_mod, "ROWS_GEMM", False)
    lin(x[2])
    assert calls == [2, 32, 32]
