"""The DFlash drafter's fused block forward (engine/speculative/dflash_fused.py) against its reference path,
with the Triton kernels under the interpreter (CPU): contexts of different lengths padded to one, an empty
one, several layers, bias-free and biased projections. (On a GPU, tests/test_gpu_engine.py drafts through
it with and without CUDA graphs.)"""
from __future__ import annotations

import pytest
import torch

from tests.triton_interpret import run_interpreted

pytest.importorskip("triton")

def random_drafter(bias: bool = False, bf16_values: bool = False):
    """A two-layer drafter of random weights (norms near 1); `bf16_values`: every weight a bfloat16 number."""
    from onecat.engine.speculative.dflash_model import DFlashDrafter

    cfg = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
           "attention_bias": bias, "dflash_config": {"block_size": 8, "target_layer_ids": [0, 1], "mask_token_id": 0}}
    drafter = DFlashDrafter(cfg, 128).eval()
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            value = torch.randn_like(p) * (0.3 if "norm" not in name else 0.2) + (1.0 if "norm" in name else 0.0)
            p.copy_(value.bfloat16().float() if bf16_values else value)
    return drafter


def reference_case(bias: bool = False, bf16_values: bool = False):
    """A random drafter, three requests' blocks (8 rows) with contexts padded to 12 rows (5 visible, none, all 12),
    their context K/V, and the reference path's output: (drafter, layer_kv, lens, block_pos, embeds, reference)."""
    from onecat.engine.speculative.dflash_fused import fused_forward_applies

    drafter = random_drafter(bias, bf16_values)
    R, B, C = 3, 8, 12
    feats = torch.randn(R, C, 2 * 64)
    ctx_pos = torch.arange(C).expand(R, C) + torch.tensor([[0], [5], [40]])
    lens = torch.tensor([5, 0, 12])
    block_pos = torch.tensor([[5], [5], [52]]) + torch.arange(B)
    embeds = torch.randn(R, B, 64)
    with torch.inference_mode():
        layer_kv = drafter.context_kv(drafter.context(feats), ctx_pos)
        assert not fused_forward_applies(drafter, embeds, R)
        ref = drafter.forward_cached(embeds, block_pos, layer_kv, lens)
    return drafter, layer_kv, lens, block_pos, embeds, ref


SCRIPT = r"""
import torch
from onecat.engine.speculative.dflash_fused import fused_forward_applies
from tests.test_dflash_fused import random_drafter, reference_case

torch.manual_seed(0)
for bias in (False, True):
    drafter, layer_kv, lens, block_pos, embeds, ref = reference_case(bias)
    R = embeds.shape[0]
    with torch.inference_mode():
        for m in drafter.modules():
            if hasattr(type(m), "use_fused"):
                m.use_fused = True
        assert fused_forward_applies(drafter, embeds, R) and not fused_forward_applies(drafter, embeds, 1)
        got = drafter.forward_cached(embeds, block_pos, layer_kv, lens)
    with torch.enable_grad():
        assert not fused_forward_applies(drafter, embeds, R)  # training keeps the reference path
    err = (got - ref).abs().max().item()
    assert got.shape == ref.shape and err < 2e-4 * ref.abs().max().item(), (bias, err)
    # row 1 has no context: its output must not depend on what its padded context rows hold
    with torch.inference_mode():
        for k, v in layer_kv:
            k[1].normal_()
            v[1].normal_()
        again = drafter.forward_cached(embeds, block_pos, layer_kv, lens)
    assert torch.equal(again[1], got[1])

# the context's K norm and RoPE by the fused kernel (one launch a layer, in place) against the torch ops
drafter = random_drafter()
feats, pos = torch.randn(2, 7, 2 * 64), torch.arange(7).expand(2, 7) + torch.tensor([[0], [30]])
with torch.inference_mode():
    want = drafter.context_kv(drafter.context(feats), pos)
    want_stacked = drafter.context_kv_stacked(drafter.context(feats[0]), pos[0])
    for m in drafter.modules():
        if hasattr(type(m), "use_fused"):
            m.use_fused = True
    got = drafter.context_kv(drafter.context(feats), pos)
    got_stacked = drafter.context_kv_stacked(drafter.context(feats[0]), pos[0])
for (gk, gv), (wk, wv) in zip(got, want):
    assert gk.shape == wk.shape == (2, 7, 2, 16) and torch.equal(gv, wv), gk.shape
    assert (gk - wk).abs().max().item() < 1e-5 * wk.abs().max().item()
assert got_stacked.shape == want_stacked.shape == (2, 2, 7, 2, 16)
assert (got_stacked - want_stacked).abs().max().item() < 1e-5 * want_stacked.abs().max().item()
assert torch.equal(want_stacked[1, 0], want[1][0][0])
assert torch.equal(got_stacked[:, 1], torch.stack([v[0] for _, v in got]))
print("ok")
"""


def test_fused_block_forward_matches_the_reference_path():
    run_interpreted(SCRIPT, timeout=300)


def test_a_drafter_on_the_cpu_without_the_fused_ops_keeps_the_reference_path(tmp_path):
    from onecat.engine.speculative.dflash_fused import fused_forward_applies
    from tests.test_speculative import write_random_dflash
    from onecat.engine.speculative.dflash_model import DFlashDrafter
    import json

    path = write_random_dflash(tmp_path / "d", 64, 0, [0], block_size=4)
    drafter = DFlashDrafter(json.loads((path / "config.json").read_text()), 64)
    with torch.inference_mode():
        assert not fused_forward_applies(drafter, torch.zeros(2, 4, 64), 2)


def test_fused_block_forward_on_the_cpu_ops_matches_the_reference_path():
    """On a CPU the fused path runs the C++ ops (norms with their residual adds, q/k norm + RoPE, SiLU*mul) and
    q/k/v in one batch-invariant matmul: the reference path's result to float32 rounding, with padded contexts,
    an empty one, one request whose context is all visible (no mask), and bf16-valued weights (packed as bf16)."""
    from onecat.engine.kernels import cpu_ops
    from onecat.engine.speculative.dflash_fused import fused_forward_applies
    from onecat.engine.worker.fused_kernels import enable_fused_kernels

    if cpu_ops.unavailable_reason() is not None:
        pytest.skip(f"CPU fused ops unavailable: {cpu_ops.unavailable_reason()}")
    torch.manual_seed(0)
    drafter, layer_kv, lens, block_pos, embeds, ref = reference_case(bf16_values=True)  # bf16 weights in float32
    R = embeds.shape[0]
    with torch.inference_mode():
        alone = drafter.forward_cached(embeds[2:], block_pos[2:], [(k[2:], v[2:]) for k, v in layer_kv], lens[2:])
        assert enable_fused_kernels(drafter, torch.device("cpu"), torch.float32, True)["used"]
        assert fused_forward_applies(drafter, embeds, R) and not fused_forward_applies(drafter, embeds, 1)
        assert not fused_forward_applies(drafter, embeds.double(), R)
        got = drafter.forward_cached(embeds, block_pos, layer_kv, lens)
        got_alone = drafter.forward_cached(embeds[2:], block_pos[2:], [(k[2:], v[2:]) for k, v in layer_kv],
                                           lens[2:])
    for out, want in ((got, ref), (got_alone, alone)):
        err = (out - want).abs().max().item()
        assert out.shape == want.shape and err < 2e-5 * want.abs().max().item(), err
    packed = drafter.layers[0].self_attn._batch_invariant_weight
    assert packed.rows is False or packed.blocked.dtype == torch.bfloat16  # the stacked q/k/v, as bf16
    with torch.enable_grad():
        assert not fused_forward_applies(drafter, embeds, R)  # training keeps the reference path
