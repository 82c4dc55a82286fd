"""The few-row GEMM (engine/kernels/triton_rows_gemm.py) under Triton's interpreter (CPU): plain, with bias and
with SiLU*up, in both operand orders (SWAP), for row counts from 2 to 32 and shapes that end off the tiles,
against a float32 product. (The GPU is checked in tests/test_rows_gemm_gpu.py.)"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

SCRIPT = r"""
import torch
import triton.runtime.interpreter as interpreter

_patch = interpreter._patch_lang_tensor


def _scalar_index(tensor, scope):  # a runtime loop bound: Triton 3.6's interpreter takes int() of a 1-element
    _patch(tensor, scope)          # array, which NumPy 2.x refuses; read the element instead
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))


interpreter._patch_lang_tensor = _scalar_index
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
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
