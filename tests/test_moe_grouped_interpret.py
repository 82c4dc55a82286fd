"""A MoE layer's packed experts grouped by expert (engine/kernels/triton_moe_grouped.py) under Triton's interpreter,
on the CPU: the device-built schedule covers every pair once, in blocks of one expert each; each pair's gate/up and
down products against its expert's exactly dequantized weight (NVFP4, MXFP4, W4A16 with its (scale, zero) pairs
interleaved as the routed stacks keep them); the layer's grouped path against its per-expert loop. The GPU runs the
same kernel (tests/test_moe_grouped_gpu.py)."""
from __future__ import annotations

import pytest
import torch

from tests.triton_interpret import run_interpreted

pytest.importorskip("triton")


def test_grouped_schedule_covers_every_pair_once_in_single_expert_blocks():
    from onecat.engine.kernels.triton_moe_grouped import grouped_schedule

    gen = torch.Generator().manual_seed(3)
    for experts, pairs, block in ((6, 37, 8), (256, 40, 32), (4, 64, 16), (3, 1, 32)):
        ids = torch.randint(0, experts, (pairs,), generator=gen)
        order, sched = grouped_schedule(ids, experts, block)
        expert, first, count = sched.tolist()
        assert sorted(order.tolist()) == list(range(pairs))
        seen = []
        for e, f, c in zip(expert, first, count):
            if e < 0:
                assert c == 0
                continue
            assert 1 <= c <= block and all(ids[p] == e for p in order[f:f + c].tolist())
            seen.extend(range(f, f + c))
        assert sorted(seen) == list(range(pairs)), (experts, pairs, block)
        assert len(expert) >= sum(-(-int(n) // block) for n in torch.bincount(ids, minlength=experts))


SCRIPT = r"""
import torch
import torch.nn.functional as F
from onecat.engine.kernels import triton_moe_grouped as grouped
from onecat.engine.layers.moe import PackedExperts
from onecat.engine.quant.fp4.layout import dequantize as fp4_dense
from onecat.engine.quant.fp4.linear import FP4Linear
from onecat.engine.quant.rtn import quantize
from onecat.engine.quant.w4a16.layout import dequantize as w4_dense
from onecat.engine.quant.w4a16.linear import W4A16Linear

torch.manual_seed(0)
experts, hidden, inter, tokens, top_k = 5, 128, 128, 40, 2
for fmt in ("nvfp4", "mxfp4", "w4a16"):
    kind, dense, group = (W4A16Linear, w4_dense, {"group": 64}) if fmt == "w4a16" else (FP4Linear, fp4_dense, {})
    packed = (lambda n, k: kind(quantize(torch.randn(n, k) * 0.2, fmt, **group)))
    layer = PackedExperts([packed(2 * inter, hidden) for _ in range(experts)],
                          [packed(hidden, inter) for _ in range(experts)], inter)
    x = torch.randn(tokens, hidden).half()
    ids = torch.stack([torch.randperm(experts)[:top_k] for _ in range(tokens)])
    w = torch.softmax(torch.randn(tokens, top_k), -1).half()
    loop = layer(x.float(), w.float(), ids)  # the per-expert loop, float32
    layer.routed = layer._stack()
    kind_id = {"int4": grouped.W4A16, **layer.FP4_FORMATS}[layer.routed]
    flat = ids.flatten()
    order, sched = grouped.grouped_schedule(flat, experts)
    words, scales, second, _, g = layer._operands("gate_up")
    h = grouped.grouped_gemm(x, words, scales, second, kind_id, g, order, sched, x_div=top_k)
    for p, e in enumerate(flat.tolist()):
        ref = x[p // top_k].float() @ dense(layer.gate_up[e].packed()).float().T
        assert (h[p].float() - ref).abs().max() <= 0.01 * ref.abs().max() + 1e-3, (fmt, "gate_up", p)
    act = torch.randn(len(flat), inter).half()
    words, scales, second, _, g = layer._operands("down")
    y = grouped.grouped_gemm(act, words, scales, second, kind_id, g, order, sched, x_div=1)
    for p, e in enumerate(flat.tolist()):
        ref = act[p].float() @ dense(layer.down[e].packed()).float().T
        assert (y[p].float() - ref).abs().max() <= 0.01 * ref.abs().max() + 1e-3, (fmt, "down", p)
    got = layer._grouped(x, w, ids)
    assert (got.float() - loop).abs().max() <= 0.01 * loop.abs().max(), fmt
print("ok")
"""


def test_grouped_experts_under_the_interpreter():
    run_interpreted(SCRIPT)
