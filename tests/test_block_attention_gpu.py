"""The DFlash drafter's block attention kernel (engine/kernels/triton_block_attention.py) on a GPU, at the drafters'
real head sizes (128: the 8B shape's; 256: route 1's Qwen3.5-27B drafter) in float16 and bfloat16: within rounding
of scaled_dot_product_attention over the concatenated context and block in float32, equal eagerly and replayed
from a CUDA graph whose lengths change between replays, and blind to whatever lies past each request's length."""
from __future__ import annotations

import pytest
import torch

from tests.block_attention_reference import reference

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("nh,nkv,hd", [(32, 8, 128), (24, 4, 256)])
def test_block_attention_on_the_gpu(dtype, nh, nkv, hd):
    from onecat.engine.kernels.triton_block_attention import block_attention

    torch.manual_seed(0)
    R, B, C = 3, 16, 520
    dev = torch.device("cuda")
    qkv = torch.randn(R * B, (nh + 2 * nkv) * hd, device=dev).to(dtype)
    room = torch.randn(2, 4, C + 40, nkv, hd, device=dev).to(dtype)  # a static buffer with room past C
    k_ctx, v_ctx = room[0, :R, :C], room[1, :R, :C]
    lens = torch.tensor([C, 0, 77], dtype=torch.int32, device=dev)
    scale = hd ** -0.5
    got = block_attention(qkv, k_ctx, v_ctx, lens, nh, nkv, hd, B, scale)
    want = reference(qkv, k_ctx, v_ctx, lens, nh, nkv, hd, B, scale)
    tol = 2e-3 if dtype == torch.float16 else 1.6e-2
    assert got.dtype == dtype and (got.float() - want).abs().max().item() < tol
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        replayed = block_attention(qkv, k_ctx, v_ctx, lens, nh, nkv, hd, B, scale)
    g.replay()
    assert torch.equal(replayed, got)
    lens.copy_(torch.tensor([5, 300, C], dtype=torch.int32))
    for r, n in enumerate(lens.tolist()):
        room[:, r, n:].normal_()
    g.replay()
    again = reference(qkv, k_ctx, v_ctx, lens, nh, nkv, hd, B, scale)
    assert (replayed.float() - again).abs().max().item() < tol
    assert torch.equal(replayed, block_attention(qkv, k_ctx, v_ctx, lens, nh, nkv, hd, B, scale))
