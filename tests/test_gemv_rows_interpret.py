"""The batch-1 GEMV's two launch shapes under Triton's interpreter (CPU): one program per input row, and
programs that walk every row of their output tile (a verify step's rows, triton_gemv.ROW_LOOP). Each row of
a several-row call must equal that row's one-row call and the float32 product, plain, with the norm folded
in, and with the SiLU*up pair. (The GPU's bits are checked in tests/test_gemv_gpu.py.)"""
from __future__ import annotations

import pytest

from tests.triton_interpret import run_interpreted

pytest.importorskip("triton")

SCRIPT = r"""
import torch
from onecat.engine.kernels import triton_gemv as tg
torch.manual_seed(0)
for n, k, glu, norm, rows in [(96, 256, False, False, 5), (64, 384, True, False, 3), (80, 256, False, True, 4),
                              (48, 128, True, True, 2)]:
    w = torch.randn(n, k, dtype=torch.float16) * 0.05
    x, r = torch.randn(rows, k, dtype=torch.float16), torch.randn(rows, k, dtype=torch.float16)
    nw = torch.rand(k, dtype=torch.float16) + 0.5
    kw = dict(residual=r, norm_weight=nw, eps=1e-6) if norm else {}
    first = lambda y: y[0] if isinstance(y, tuple) else y
    got = {}
    for loop in (False, True):
        tg.ROW_LOOP = loop
        got[loop] = first(tg.gemv(x, w, glu=glu, **kw))
    alone = torch.cat([first(tg.gemv(x[i:i + 1], w, glu=glu, **({**kw, "residual": r[i:i + 1]} if norm else {})))
                       for i in range(rows)])
    assert torch.equal(got[True], got[False]) and torch.equal(got[True], alone), (n, k, glu, norm)
    h = x.float() + r.float() if norm else x.float()
    if norm:
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * nw.float()
    ref = h @ w.float().T
    if glu:
        g, u = ref.chunk(2, -1)
        ref = torch.nn.functional.silu(g) * u
    err = (got[True].float() - ref).abs().max().item()
    assert err < 5e-3, (n, k, glu, norm, err)
print("ok")
"""


def test_row_loop_and_row_programs_give_each_row_its_one_row_result():
    run_interpreted(SCRIPT, timeout=240)
