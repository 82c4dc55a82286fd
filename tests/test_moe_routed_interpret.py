"""Packed MoE experts picked on the device (engine/layers/moe.py PackedExperts, engine/kernels/triton_moe_routed.py)
under Triton's interpreter, on the CPU: NVFP4, MXFP4 and W4A16 experts; every (token, expert) pair against the
expert's exactly dequantized weight, a pair's result independent of the other pairs, the layer's routed path against
its per-expert loop (the path steps of many tokens take), and the two fused kernels (SiLU * mul in the gate/up
kernel, the weighted top-k sum in the down kernel) against the separate ops they replace, and the kernels' other
tilings (RoutedTiles: gate and up rows in one tile, a token's pairs in one tile) against the default one (marked
slow: the engine launches only the per-format defaults, which the first test runs). CUDA runs
the same kernels (tests/test_moe_gpu.py, the seed MoE route's GPU benchmark, benchmarks/gpu_moe_routed.py)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.triton_interpret import run_interpreted

pytest.importorskip("triton")

SCRIPT = r"""
import torch
from onecat.engine.layers.moe import PackedExperts
from onecat.engine.quant.fp4.layout import dequantize as fp4_dense
from onecat.engine.quant.fp4.linear import FP4Linear
from onecat.engine.quant.rtn import quantize
from onecat.engine.quant.w4a16.layout import dequantize as w4_dense
from onecat.engine.quant.w4a16.linear import W4A16Linear

torch.manual_seed(0)
for fmt in ("nvfp4", "mxfp4", "w4a16"):
    experts, hidden, inter, tokens, top_k = 5, 128, 64, 3, 2
    kind, dense = (W4A16Linear, w4_dense) if fmt == "w4a16" else (FP4Linear, fp4_dense)
    gate_up = [kind(quantize(torch.randn(2 * inter, hidden) * 0.2, fmt, **({"group": 32} if fmt == "w4a16" else {})))
               for _ in range(experts)]
    down = [kind(quantize(torch.randn(hidden, inter) * 0.2, fmt, **({"group": 64} if fmt == "w4a16" else {})))
            for _ in range(experts)]  # W4A16: another group size than gate_up's, as a narrow down projection takes
    x = torch.randn(tokens, hidden).to(torch.bfloat16)
    ids = torch.tensor([[4, 1], [1, 1], [0, 3]])
    weights = torch.softmax(torch.randn(tokens, top_k), -1).to(torch.bfloat16)

    layer = PackedExperts(gate_up, down, inter)
    assert layer.routed is None  # CPU tensors: the loop, unless stacked on purpose
    loop = layer(x, weights, ids)
    dense_gate_up = [dense(m.packed()).float() for m in gate_up]
    layer.routed = layer._stack()
    assert layer.routed == {"w4a16": "int4"}.get(fmt, fmt), layer.routed
    assert layer.gate_up[1].qweight.data_ptr() == layer.gate_up_qweight[1].data_ptr()  # a slice, no copy
    assert torch.equal(layer(x, weights, ids), loop)  # each expert's layer reads its slice of the stack

    flat = ids.flatten()
    y = layer._routed_gemv("gate_up", x, flat, top_k, per_pair=False)
    for p, e in enumerate(flat.tolist()):
        ref = x[p // top_k].float() @ dense_gate_up[e].T
        assert (y[p].float() - ref).abs().max() <= 0.02 * ref.abs().max() + 1e-3, (fmt, p)
    h = torch.randn(len(flat), inter).to(torch.bfloat16)  # one row per pair
    z = layer._routed_gemv("down", h, flat, top_k, per_pair=True)
    for p, e in enumerate(flat.tolist()):
        ref = h[p].float() @ dense(down[e].packed()).float().T
        assert (z[p].float() - ref).abs().max() <= 0.02 * ref.abs().max() + 1e-3, (fmt, "down", p)
    alone = layer._routed_gemv("gate_up", x[2:3].contiguous(), ids[2].contiguous(), top_k, per_pair=False)
    assert torch.equal(alone, y[4:6]), fmt  # a pair's result does not depend on the other pairs
    layer.FUSED = False  # the separate kernels here (bf16: the fused ones are checked in fp16 below)
    got = layer._routed(x, weights, ids)
    assert (got.float() - loop.float()).abs().max() <= 0.02 * loop.float().abs().max() + 1e-3, fmt

    # the two fused kernels: SiLU * mul in the gate/up kernel, the weighted top-k sum in the down kernel, with the
    # separate ops' roundings (each product rounded to the activation dtype; SiLU * mul as triton_fused.silu_mul
    # computes it). fp16 here: the interpreter's float32 -> bf16 conversion inside a kernel is not a rounding
    if fmt == "mxfp4":  # the kernels share NVFP4's code path but for the scale decode (checked above)
        continue
    from onecat.engine.kernels import triton_moe_routed as kernels
    x16, w16 = x.half(), weights.float()
    y16 = layer._routed_gemv("gate_up", x16, flat, top_k, per_pair=False)
    glu = kernels.routed_glu(x16, *layer._operands("gate_up"), flat, top_k)
    g, u = y16.float().split(inter, dim=-1)
    want_glu = (g / (1.0 + torch.exp(-g))).half() * u.half()
    assert glu.shape == want_glu.shape and (glu.float() - want_glu.float()).abs().max() <= \
        2e-3 * want_glu.float().abs().max(), fmt
    summed = kernels.routed_down_sum(glu, *layer._operands("down"), flat, w16, top_k)
    per_pair = layer._routed_gemv("down", glu, flat, top_k, per_pair=True).float().view(tokens, top_k, -1)
    want = torch.zeros(tokens, hidden)
    for j in range(top_k):  # in top-k order
        want += per_pair[:, j] * w16[:, j:j + 1]
    assert torch.equal(summed, want.half()), (fmt, (summed.float() - want).abs().max())
    own = torch.Generator().manual_seed(7)  # the formats after this one draw the weights they drew before
    gate_logit = torch.randn(tokens, 1, generator=own).half()
    shared_out = torch.randn(tokens, hidden, generator=own).half()
    with_shared = kernels.routed_down_sum(glu, *layer._operands("down"), flat, w16, top_k, (gate_logit, shared_out))
    want_shared = (summed.float() + (torch.sigmoid(gate_logit.float()).half() * shared_out).float()).half()
    assert (with_shared.float() - want_shared.float()).abs().max() <= 2e-3 * want_shared.float().abs().max(), fmt
    layer.FUSED = True  # the layer's fused path: these two kernels on these inputs (the separate path: got above)
    assert torch.equal(layer._routed(x16, w16, ids), summed), fmt
    layer.FUSED = False
print("ok")
"""


def test_routed_packed_experts_under_the_interpreter():
    run_interpreted(SCRIPT, timeout=300)


TILINGS_SCRIPT = r"""
import torch
from onecat.engine.kernels import triton_moe_routed as kr
from onecat.engine.layers.moe import PackedExperts
from onecat.engine.quant.fp4.linear import FP4Linear
from onecat.engine.quant.rtn import quantize
from onecat.engine.quant.w4a16.linear import W4A16Linear

torch.manual_seed(1)
experts, hidden, inter, tokens, top_k = 6, 128, 64, 3, 4
for fmt in ("nvfp4", "w4a16"):
    kind, group = (W4A16Linear, {"group": 32}) if fmt == "w4a16" else (FP4Linear, {})
    packed = (lambda n, k: kind(quantize(torch.randn(n, k) * 0.2, fmt, **group)))
    layer = PackedExperts([packed(2 * inter, hidden) for _ in range(experts)],
                          [packed(hidden, inter) for _ in range(experts)], inter)
    layer.routed = layer._stack()
    up, down = layer._operands("gate_up"), layer._operands("down")
    x = torch.randn(tokens, hidden).half()
    ids = torch.stack([torch.randperm(experts)[:top_k] for _ in range(tokens)]).flatten()
    w = torch.softmax(torch.randn(tokens, top_k), -1)
    shared = (torch.randn(tokens, 1).half(), torch.randn(tokens, hidden).half())

    def glu(t):
        return kr._launch(x, *up[:3], kr.FORMATS[up[3]], up[4], ids, top_k, per_pair=False, glu=True, tiles=t)

    def summed(h, t, with_shared=None):
        return kr._launch(h, *down[:3], kr.FORMATS[down[3]], down[4], ids, top_k, per_pair=True,
                          weights=w.reshape(-1).contiguous(), shared=with_shared, tiles=t)

    h = glu(kr.DEFAULT_TILES)
    # interpreted, a row's products and sums are in the same order whatever shares its tile: equal bit for bit
    t = kr.RoutedTiles(block_n=32, warps=4, glu_together=True)
    assert torch.equal(glu(t), h), (fmt, t)
    assert torch.equal(glu(None), h), (fmt, "the format's default tiling")  # as PackedExperts launches it
    base, base_shared = summed(h, kr.DEFAULT_TILES), summed(h, kr.DEFAULT_TILES, shared)
    assert torch.equal(summed(h, kr.RoutedTiles(pairs=2)), base), fmt
    assert torch.equal(summed(h, None, shared), base_shared), (fmt, "the format's default tiling")
    t = kr.RoutedTiles(block_n=8, pairs=4)
    assert torch.equal(summed(h, t, shared), base_shared), (fmt, t, "shared")
    alone = kr._launch(h[4:8].contiguous(), *down[:3], kr.FORMATS[down[3]], down[4], ids[4:8].contiguous(), top_k,
                       per_pair=True, weights=w.reshape(-1)[4:8].contiguous(), tiles=t)
    assert torch.equal(alone, base[1:2]), fmt  # a token's sum does not depend on the other tokens
print("ok")
"""


@pytest.mark.slow  # ~50 s on two cores: the tilings the engine launches run in the test above; these are the others
def test_routed_tilings_under_the_interpreter():
    run_interpreted(TILINGS_SCRIPT, timeout=300)


def test_routed_tiles_from_the_environment_are_checked():
    from onecat.engine.kernels.triton_moe_routed import DEFAULT_KERNEL_TILES, DEFAULT_TILES, RoutedTiles, parse_tiles

    assert parse_tiles("block_n=32, max_words=128,warps=4,glu_together=1,pairs=2") == \
        RoutedTiles(32, 128, 4, True, 2)
    assert parse_tiles("pairs=4") == DEFAULT_TILES._replace(pairs=4)
    for bad in ("pairs=3", "block_n=12", "warps=two", "width=16", "block_n"):
        with pytest.raises(ValueError, match="ONECAT_MOE_ROUTED_GLU_TILES"):
            parse_tiles(bad, "ONECAT_MOE_ROUTED_GLU_TILES")
    env = {**os.environ, "ONECAT_MOE_ROUTED_DOWN_TILES": "block_n=8,pairs=4"}
    env.pop("ONECAT_MOE_ROUTED_GLU_TILES", None)
    read = subprocess.run([sys.executable, "-c", "from onecat.engine.kernels.triton_moe_routed import TILES_IN_USE as t; "
                           "print(t['glu'][0]); print(t['down_sum'][0]); print(t['down_sum'][2])"], env=env,
                          capture_output=True, text=True, timeout=120)
    # the variable names one tiling for every format; the other kernel keeps its per-format defaults
    chosen = str(RoutedTiles(block_n=8, pairs=4))
    assert read.stdout.splitlines() == [str(DEFAULT_KERNEL_TILES["glu"][0]), chosen, chosen], read.stderr
