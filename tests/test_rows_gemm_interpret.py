"""The few-row GEMM (engine/kernels/triton_rows_gemm.py) under Triton's interpreter (CPU): plain, with bias and
with SiLU*up, in both operand orders (SWAP), for row counts from 2 to 32 and shapes that end off the tiles,
against a float32 product. (The GPU is checked in tests/test_rows_gemm_gpu.py.)"""
from __future__ import annotations

import pytest
from triton_interpret import run_interpreted

pytest.importorskip("triton")

SCRIPT = r"""
import torch
from onecat.engine.kernels import triton_rows_gemm as rg

torch.manual_seed(0)
for n, k, glu, bias, rows in [(96, 272, False, False, 5), (64, 384, True, True, 3), (80, 256, False, False, 16),
                              (48, 128, True, True, 17), (40, 144, False, True, 32), (200, 160, True, False, 2)]:
    w = torch.randn(n, k, dtype=torch.float16) * 0.05
    b = torch.randn(n, dtype=torch.float16) if bias else None
    x = torch.randn(rows, k, dtype=torch.float16)
    ref = x.float() @ w.float().T + (b.float() if bias else 0)
    if glu:
        g, u = ref.chunk(2, -1)
        ref = torch.nn.functional.silu(g.half().float()).half().float() * u.half().float()
    for swap in (False, True):
        m, bn, bk, st, wp, _ = rg.default_config(rows, n // 2 if glu else n, k, glu)
        y = rg.rows_gemm(x, w, b, glu=glu, config=(m, bn, min(bk, 64), st, wp, swap))
        err = (y.float() - ref).abs().max().item()
        assert y.shape == (rows, n // 2 if glu else n) and err < 5e-3, (n, k, glu, bias, rows, swap, err)
print("ok")
"""


def test_rows_gemm_matches_the_float32_product_in_both_operand_orders():
    run_interpreted(SCRIPT)
