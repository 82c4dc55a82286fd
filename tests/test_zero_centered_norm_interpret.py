"""Qwen3.5's zero-centered add + RMSNorm through the fused Triton kernel (engine/kernels/triton_fused.py
add_rmsnorm, zero_centered) under Triton's interpreter on the CPU, against ZeroCenteredRMSNorm's torch ops: the
residual sum bit for bit, the normed rows to float16 rounding (the mean of squares is summed in another order),
for a layer's rows and for per-head q/k rows read through a strided view."""
from __future__ import annotations

import pytest

from tests.triton_interpret import run_interpreted

SCRIPT = r"""
import torch
torch.set_grad_enabled(False)
from onecat.engine.kernels.triton_fused import add_rmsnorm
from onecat.engine.layers.qwen3_5_norms import ZeroCenteredRMSNorm

torch.manual_seed(0)
for n in (64, 200):
    norm = ZeroCenteredRMSNorm(n, 1e-6).half()
    norm.weight.normal_(0.0, 0.2)
    x, r = torch.randn(3, n).half(), (torch.randn(3, n) * 4).half()
    want, want_res = norm(x, r)
    got, got_res = add_rmsnorm(x, r, norm.weight, 1e-6, zero_centered=True)
    assert torch.equal(got_res, want_res)
    ulp = (want.float().abs() * 2 ** -10).clamp(min=2 ** -24)
    assert ((got.float() - want.float()).abs() <= ulp).all(), (got.float() - want.float()).abs().max()
    heads = torch.randn(3, 4, 2 * n).half()[..., :n]
    want = norm(heads)
    got = add_rmsnorm(heads, None, norm.weight, 1e-6, zero_centered=True)
    assert got.shape == want.shape
    ulp = (want.float().abs() * 2 ** -10).clamp(min=2 ** -24)
    assert ((got.float() - want.float()).abs() <= ulp).all(), (got.float() - want.float()).abs().max()
    plain = add_rmsnorm(x, None, norm.weight, 1e-6)  # the Llama form multiplies by the weight itself
    assert not torch.allclose(plain.float(), norm(x).float(), atol=1e-2)
print("ok")
"""


def test_zero_centered_add_rmsnorm_matches_the_torch_norm_under_the_interpreter():
    pytest.importorskip("triton")
    run_interpreted(SCRIPT)
