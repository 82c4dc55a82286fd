"""Packed FP4 MoE experts picked on the device (engine/layers/moe.py PackedExperts, engine/kernels/
triton_fp4_routed.py) under Triton's interpreter, on the CPU: every (token, expert) pair against the expert's
exactly dequantized weight, a pair's result independent of the other pairs, and the layer's routed path against
its per-expert loop (the path steps of many tokens take). CUDA runs the same kernel (the seed MoE route's GPU
benchmark; tests/test_packed_moe_hybrid.py covers the layer's loading)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

SCRIPT = r"""
import torch
from onecat.engine.kernels import triton_fp4_routed as routed
from onecat.engine.layers.moe import PackedExperts
from onecat.engine.quant.fp4.layout import dequantize
from onecat.engine.quant.fp4.linear import FP4Linear
from onecat.engine.quant.rtn import quantize

torch.manual_seed(0)
for fmt in ("nvfp4", "mxfp4"):
    experts, hidden, inter, tokens, top_k = 5, 128, 64, 3, 2
    gate_up = [quantize(torch.randn(2 * inter, hidden) * 0.2, fmt) for _ in range(experts)]
    down = [quantize(torch.randn(hidden, inter) * 0.2, fmt) for _ in range(experts)]
    x = torch.randn(tokens, hidden).to(torch.bfloat16)
    ids = torch.tensor([[4, 1], [1, 1], [0, 3]])
    weights = torch.softmax(torch.randn(tokens, top_k), -1).to(torch.bfloat16)

    fid = PackedExperts.FP4_FORMATS[fmt]
    stack = lambda ws, f: torch.stack([f(w) for w in ws])
    gscale = (lambda w: w.gscale) if fmt == "nvfp4" else (lambda w: torch.ones(w.out_features))
    y = routed.routed_gemv(x, stack(gate_up, lambda w: w.qweight), stack(gate_up, lambda w: w.scales),
                           stack(gate_up, gscale), fid, ids.flatten(), top_k, per_pair=False)
    for p, e in enumerate(ids.flatten().tolist()):
        ref = x[p // top_k].float() @ dequantize(gate_up[e]).float().T
        assert (y[p].float() - ref).abs().max() <= 0.02 * ref.abs().max() + 1e-3, (fmt, p)
    alone = routed.routed_gemv(x[2:3], stack(gate_up, lambda w: w.qweight), stack(gate_up, lambda w: w.scales),
                               stack(gate_up, gscale), fid, ids[2], top_k, per_pair=False)
    assert torch.equal(alone, y[4:6]), fmt  # a pair's result does not depend on the other pairs

    layer = PackedExperts([FP4Linear(w) for w in gate_up], [FP4Linear(w) for w in down], inter)
    assert layer.routed_format is None  # CPU tensors: the loop, unless stacked on purpose
    loop = layer(x, weights, ids)
    layer.routed_format = layer._stack_fp4()
    assert layer.routed_format == fid and layer.gate_up[1].qweight.data_ptr() == layer.gate_up_words[1].data_ptr()
    assert torch.equal(layer(x, weights, ids), loop)  # each expert's layer reads its slice of the stack
    got = layer._routed(x, weights, ids)
    assert (got.float() - loop.float()).abs().max() <= 0.02 * loop.float().abs().max() + 1e-3, fmt
print("ok")
"""


def test_routed_fp4_experts_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
