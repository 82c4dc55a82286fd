"""A MoE layer's packed experts grouped by expert on a CUDA GPU (engine/kernels/triton_moe_grouped.py; skipped
without one): a long step's grouped path against the per-expert loop it replaces (NVFP4, MXFP4, W4A16; bf16 and
fp16 rows), skewed routing included, and the layer taking it when ONECAT_MOE_GROUPED_PREFILL is on."""
from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _layer(fmt: str, experts: int, hidden: int, inter: int):
    from onecat.engine.kernels.triton_support import grouped_moe_take
    from onecat.engine.layers.moe import PackedExperts
    from onecat.engine.quant.fp4.linear import FP4Linear
    from onecat.engine.quant.rtn import quantize
    from onecat.engine.quant.w4a16.linear import W4A16Linear

    if not grouped_moe_take(torch.empty(1, 128, device="cuda", dtype=torch.float16), (128,)):
        pytest.skip("the grouped experts need an SM80+ GPU and Triton")
    kind = W4A16Linear if fmt == "w4a16" else FP4Linear
    packed = (lambda n, k: kind(quantize(torch.randn(n, k, device="cuda") * k ** -0.5, fmt, group=128)))
    return PackedExperts([packed(2 * inter, hidden) for _ in range(experts)],
                         [packed(hidden, inter) for _ in range(experts)], inter)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "w4a16"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_grouped_experts_equal_the_per_expert_loop(fmt, dtype):
    if fmt == "w4a16" and dtype == torch.bfloat16:
        pytest.skip("W4A16 layers take fp16 rows")
    torch.manual_seed(0)
    experts, hidden, inter, tokens, top_k = 32, 512, 256, 600, 4
    layer = _layer(fmt, experts, hidden, inter)
    assert layer.routed is not None
    x = torch.randn(tokens, hidden, device="cuda", dtype=dtype)
    ids = torch.stack([torch.randperm(experts, device="cuda")[:top_k] for _ in range(tokens)])
    for t in range(tokens // 2):  # skewed: half the tokens pick expert 3 first (a run of many blocks)
        rest = torch.randperm(experts - 1, device="cuda")[:top_k - 1]
        ids[t] = torch.cat([torch.tensor([3], device="cuda"), rest + (rest >= 3)])
    weights = torch.softmax(torch.randn(tokens, top_k, device="cuda"), -1).to(dtype)
    grouped = layer._grouped(x, weights, ids)
    layer.GROUPED_PREFILL = False
    loop = layer(x, weights, ids)
    assert layer.path == "packed_loop"
    err = (grouped.float() - loop.float()).abs().max() / loop.float().abs().max()
    assert err < 2e-2, (fmt, dtype, float(err))
    layer.GROUPED_PREFILL = True
    again = layer(x, weights, ids)
    assert layer.path == "grouped" and torch.equal(again, grouped)
