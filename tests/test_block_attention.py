"""The DFlash drafter's block attention kernel (engine/kernels/triton_block_attention.py) under Triton's
interpreter (CPU) against scaled_dot_product_attention over the concatenated context and block: requests whose
contexts are padded to one buffer (lengths 0, partial, whole; one spanning several key parts), a context buffer
with room past its rows (a CUDA graph's static buffer), contexts long enough that each program walks several
tiles, float32 and float16, blocks of 8 and 16 rows, the SM80+ and the V100 tilings. And the
drafter's fused forward takes it where it runs (tests/test_dflash_fused.py compares that forward's output)."""
from __future__ import annotations

import pytest

from tests.triton_interpret import run_interpreted

pytest.importorskip("triton")

SCRIPT = r"""
import torch
from onecat.engine.kernels.triton_block_attention import (MAX_CONTEXT_PARTS, PART, SM70_PART, SM70_WARPS,
                                                          block_attention, config)
from tests.block_attention_reference import reference

assert config(128, 90) == (PART, 4) and config(256, 80) == (PART, 8)
assert config(128, 70) == (SM70_PART, SM70_WARPS) and config(256, 70) is None  # V100: SDPA at head size 256

torch.manual_seed(0)
nh, nkv, hd = 4, 2, 16
for dtype, B, C, lens, tiling in ((torch.float32, 8, 12, [5, 0, 12], (PART, 4)),
                                  (torch.float16, 16, PART + 7, [PART + 7, 3, PART + 1], (PART, 4)),
                                  (torch.float32, 16, 2 * PART + 5, [2 * PART, 0, 1], (PART, 4)),
                                  # past MAX_CONTEXT_PARTS parts: each program walks several tiles
                                  (torch.float32, 8, MAX_CONTEXT_PARTS * PART + 70, [MAX_CONTEXT_PARTS * PART + 70, 0,
                                                                                     3 * PART + 9], (PART, 4)),
                                  (torch.float32, 16, 3 * SM70_PART + 2, [40, 0, 3 * SM70_PART + 2], (SM70_PART, 8)),
                                  (torch.float16, 16, 200, [200, 77, 1], (SM70_PART, 8))):
    R = len(lens)
    lens = torch.tensor(lens, dtype=torch.int32)
    qkv = torch.randn(R * B, (nh + 2 * nkv) * hd).to(dtype)
    room = torch.randn(2, R + 1, C + 9, nkv, hd).to(dtype)  # a static buffer: more rows and positions than used
    k_ctx, v_ctx = room[0, :R, :C], room[1, :R, :C]
    scale = hd ** -0.5
    got = block_attention(qkv, k_ctx, v_ctx, lens, nh, nkv, hd, B, scale, tiling)
    want = reference(qkv, k_ctx, v_ctx, lens, nh, nkv, hd, B, scale)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    err = (got.float() - want).abs().max().item()
    assert got.dtype == dtype and got.shape == want.shape and err < tol, (dtype, B, C, err)
    # what lies past each request's length never reaches its output
    for r, n in enumerate(lens.tolist()):
        room[:, r, n:].normal_()
    assert torch.equal(block_attention(qkv, k_ctx, v_ctx, lens, nh, nkv, hd, B, scale, tiling), got)

# the fused drafter forward runs it where the fused kernels do
import onecat.engine.kernels.triton_block_attention as kernel
from onecat.engine.speculative import dflash_fused
from tests.test_dflash_fused import reference_case

calls = []
original = kernel.block_attention
kernel.block_attention = lambda *a, **k: calls.append(1) or original(*a, **k)
drafter, layer_kv, lens, block_pos, embeds, ref = reference_case()
with torch.inference_mode():
    for m in drafter.modules():
        if hasattr(type(m), "use_fused"):
            m.use_fused = True
    got = drafter.forward_cached(embeds, block_pos, layer_kv, lens)
assert len(calls) == len(drafter.layers), calls
assert (got - ref).abs().max().item() < 2e-4 * ref.abs().max().item()
dflash_fused.BLOCK_ATTENTION = False  # the A/B switch: the SDPA path
with torch.inference_mode():
    other = drafter.forward_cached(embeds, block_pos, layer_kv, lens)
assert len(calls) == len(drafter.layers) and (other - ref).abs().max().item() < 2e-4 * ref.abs().max().item()
print("ok")
"""


def test_block_attention_matches_sdpa_over_the_concatenation():
    run_interpreted(SCRIPT, timeout=300)
