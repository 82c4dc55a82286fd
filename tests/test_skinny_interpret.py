"""The skinny GEMM for 2-16 rows (engine/kernels/triton_skinny.py) under Triton's interpreter (CPU): plain,
with bias, with the residual add + RMSNorm folded in (x + residual returned exactly), and with the SiLU*up
pair, against a float32 reference with the activation rounded where the unfused kernels round it. The
kernel's speed is a GPU measurement (benchmarks/gpu_gemv.py --rows)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

SCRIPT = r"""
import torch
import torch.nn.functional as F
from onecat.engine.kernels import triton_skinny as ts
torch.manual_seed(0)
for n, k, glu, norm, rows, bias in [(96, 256, False, False, 5, False), (64, 384, True, False, 3, True),
                                    (80, 200, False, True, 16, True), (48, 128, True, True, 2, False)]:
    w = torch.randn(n, k, dtype=torch.float16) * 0.05
    b = torch.randn(n, dtype=torch.float16) * 0.1 if bias else None
    x, r = torch.randn(rows, k, dtype=torch.float16), torch.randn(rows, k, dtype=torch.float16)
    nw = torch.rand(k, dtype=torch.float16) + 0.5
    kw = dict(residual=r, norm_weight=nw, eps=1e-6) if norm else {}
    out = ts.skinny(x, w, b, glu=glu, **kw)
    y = out[0] if norm else out
    a = x.float()
    if norm:
        h = x + r
        assert torch.equal(out[1], h)
        hf = h.float()
        a = ((hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-6)).half() * nw).float()
    ref = a @ w.float().T + (b.float() if bias else 0)
    if glu:
        g, u = ref.chunk(2, -1); ref = F.silu(g.half().float()).half().float() * u
    err = (y.float() - ref).abs().max().item() / ref.abs().max().item()
    print(n, k, glu, norm, rows, bias, "rel err", round(err, 5))
    assert y.shape == (rows, n // 2 if glu else n) and err < 5e-3
print("ok")
"""


def test_skinny_gemm_matches_the_float32_reference_in_every_variant():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


def test_a_cpu_input_is_refused_with_its_reason(monkeypatch):
    import torch

    from onecat.engine.kernels import triton_skinny
    from onecat.engine.layers.linear import Linear

    layer = Linear(64, 32)
    layer.use_fused = True
    monkeypatch.setattr(triton_skinny, "ENABLED", True)
    x = torch.randn(4, 64)
    assert not layer.skinny_ok(x)
    assert "CUDA" in triton_skinny.skinny_unsupported_reason(x, layer.weight)
    assert torch.equal(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))
