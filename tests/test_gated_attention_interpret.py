"""The ops around Qwen3.5's gated attention in two fused kernels (engine/kernels/triton_gated_attention.py)
under Triton's interpreter on the CPU, against GatedAttention's torch ops on the same qkv_proj rows: the normed,
rotated queries, the K/V cache rows at the tokens' slots (model dtype, fp8 e4m3 and e5m2 with their scales) and
the sigmoid gate; partial and full rotary widths, a rest width that is not a power of two. In float16 every value
is the torch path's bit for bit. The interpreter's float8 cast (not a GPU's) drops the carry into the next binade
when a value rounds up to it (125.8 -> 64 where e4m3 rounds to 128) and rounds exact ties away from even: bytes
may differ there and only there."""
from __future__ import annotations

import pytest

from tests.triton_interpret import run_interpreted

SCRIPT = r"""
import torch
torch.set_grad_enabled(False)
from onecat.engine.cache.kv import allocate_kv_caches, write_kv
from onecat.engine.config import ModelConfig
from onecat.engine.kernels import triton_gated_attention as ga
from onecat.engine.layers.gated_attention import GatedAttention
from onecat.engine.layers.rotary import RotaryEmbedding
from onecat.engine.random_models import shape_config

def check(dtype, fp8, head_dim=16, rotary=4):
    torch.manual_seed(0)
    cfg = ModelConfig.from_hf(dict(shape_config("tiny-qwen3.5"), head_dim=head_dim))
    rot = RotaryEmbedding(rotary, cfg.rope_theta, 64, cfg.rope_scaling)
    attn = GatedAttention(cfg, 0, rot)
    for p in attn.parameters():
        p.data.normal_(0, 0.3)
    attn = attn.to(dtype)
    H, Hkv, d, T = attn.num_heads, attn.num_kv_heads, head_dim, 5
    qkv = torch.randn(T, 2 * H * d + 2 * Hkv * d).to(dtype) * 2
    positions, slots = torch.tensor([0, 3, 7, 20, 63]), torch.tensor([5, 1, 9, 30, 2])
    caches = [allocate_kv_caches(1, 4, 8, Hkv, d, dtype, fp8, torch.device("cpu"))[0] for _ in range(2)]
    qg, k, v = qkv.split([2 * H * d, Hkv * d, Hkv * d], dim=-1)
    qg = qg.view(T, H, 2 * d)
    want_q = attn._rope(positions, attn.q_norm(qg[..., :d])).contiguous()
    k_rot = attn._rope(positions, attn.k_norm(k.view(T, Hkv, d)))
    write_kv(caches[0], k_rot, v.view(T, Hkv, d), slots)
    q = ga.qk_norm_rope_cache(qkv, positions, rot.cos, rot.sin, H, Hkv, d, attn.q_norm.weight, attn.k_norm.weight,
                              attn.q_norm.eps, caches[1], slots)
    o = torch.randn(T, H, d).to(dtype)
    want_gate = o.reshape(T, H * d) * torch.sigmoid(qg[..., d:].reshape(T, H * d))
    gated = ga.sigmoid_gate(o, qkv, H, d)
    what = (dtype, fp8, head_dim, rotary)
    if dtype == torch.float32:
        for got, want in ((q, want_q), (caches[1].k, caches[0].k), (gated, want_gate)):
            assert (got - want).abs().max() <= 1e-5 * want.abs().max(), what
        return
    assert torch.equal(q, want_q) and torch.equal(gated, want_gate), what
    if fp8 is None:
        assert torch.equal(caches[1].k, caches[0].k) and torch.equal(caches[1].v, caches[0].v), what
        return
    assert torch.equal(caches[1].k_scale, caches[0].k_scale) and torch.equal(caches[1].v_scale, caches[0].v_scale)
    for name, x in (("k", k_rot), ("v", v.view(T, Hkv, d))):
        got, want = (getattr(c, name).view(fp8).float() for c in (caches[1], caches[0]))
        quotient = torch.zeros_like(want)  # what each byte rounds: x / its scale, at the token's slot
        scale = getattr(caches[0], name + "_scale").view(-1, Hkv)[slots]
        quotient.view(-1, Hkv, d)[slots] = x.float() / scale.unsqueeze(-1)
        off = got != want
        assert off.float().mean() < 0.02, (what, name, float(off.float().mean()))
        carry = (got == want / 2) & (want.abs().log2().frac() == 0)
        tie = quotient == (got + want) / 2
        assert (carry | tie)[off].all(), (what, name, got[off & ~carry & ~tie], want[off & ~carry & ~tie])

check(torch.float16, None)
check(torch.float16, None, head_dim=24, rotary=8)
check(torch.float16, None, rotary=16)
check(torch.float16, torch.float8_e4m3fn)
check(torch.float16, torch.float8_e5m2)
check(torch.float32, None)
print("ok")
"""


def test_gated_attention_kernels_match_the_torch_ops_under_the_interpreter():
    pytest.importorskip("triton")
    run_interpreted(SCRIPT)
