"""The fused CPU ops (csrc/cpu/fused_ops.cpp) against the torch ops they replace, and the engine with them.

Each op must (a) agree with the reference arithmetic to float32 rounding, and (b) give every row the same
bits whatever the number of rows next to it (the engine's batch invariance rests on that).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from onecat.engine.kernels import cpu_ops
from onecat.engine.layers.rotary import RotaryEmbedding
from tests.conftest import EMBEDDED

pytestmark = pytest.mark.skipif(cpu_ops.unavailable_reason() is not None,
                                reason=f"CPU fused ops unavailable: {cpu_ops.unavailable_reason()}")


def _reference_norm(x, residual, weight, eps):
    s = x if residual is None else x + residual
    return weight * (s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps)), s


@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("bf16_out", [False, True])
def test_add_rms_norm_matches_reference_and_rows_are_independent(with_residual, bf16_out):
    g = torch.Generator().manual_seed(0)
    x, r = torch.randn(37, 576, generator=g) * 3, torch.randn(37, 576, generator=g)
    w = torch.randn(576, generator=g)
    ops = cpu_ops.load()
    out, summed = ops.add_rms_norm(x, r if with_residual else None, w, 1e-5, bf16_out)
    ref, ref_sum = _reference_norm(x, r if with_residual else None, w, 1e-5)
    assert out.dtype == (torch.bfloat16 if bf16_out else torch.float32)
    assert torch.equal(summed, ref_sum)
    tol = 1e-2 if bf16_out else 2e-6  # bf16 output: one rounding of ~3 significant digits
    torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol)
    for rows in (slice(0, 1), slice(5, 9), slice(36, 37)):  # the same row alone or among others: same bits
        part, _ = ops.add_rms_norm(x[rows], r[rows] if with_residual else None, w, 1e-5, bf16_out)
        assert torch.equal(part, out[rows])


def test_rope_write_kv_matches_reference_and_writes_the_cache():
    hq, hkv, d, rows = 9, 3, 64, 6
    rotary = RotaryEmbedding(d, 100000.0, 512, None)
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(rows, (hq + 2 * hkv) * d, generator=g)
    positions = torch.tensor([0, 1, 7, 100, 300, 511])
    slots = torch.tensor([5, 17, 2, 40, 63, 33])
    k_cache, v_cache = torch.zeros(4, 16, hkv, d), torch.zeros(4, 16, hkv, d)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    ref_q, ref_k = rotary(positions, q.reshape(rows, hq, d), k.reshape(rows, hkv, d))
    cos_half = rotary.cos[positions].unsqueeze(1)
    sin_half = rotary.sin[positions].unsqueeze(1)
    x = q.reshape(rows, hq, d)  # the textbook form, not the engine's folded-sign one
    textbook_q = x * cos_half + RotaryEmbedding._rotate_half(x) * sin_half
    v_ref = v.clone()
    work = qkv.clone()
    cpu_ops.load().rope_write_kv(work, positions, rotary.cos, rotary.sin, hq, hkv, k_cache, v_cache, slots)
    assert torch.equal(work[:, :hq * d].view(rows, hq, d), ref_q)
    assert torch.equal(ref_q, textbook_q)
    assert torch.equal(work[:, hq * d:(hq + hkv) * d].view(rows, hkv, d), ref_k)
    flat_k, flat_v = k_cache.view(-1, hkv, d), v_cache.view(-1, hkv, d)
    assert torch.equal(flat_k[slots], ref_k) and torch.equal(flat_v[slots], v_ref.view(rows, hkv, d))
    untouched = torch.ones(64, dtype=torch.bool)
    untouched[slots] = False
    assert not flat_k[untouched].any() and not flat_v[untouched].any()


def test_rope_write_kv_refuses_out_of_range_positions_and_slots():
    rotary = RotaryEmbedding(64, 10000.0, 16, None)
    qkv = torch.randn(1, 15 * 64)
    cache = torch.zeros(2, 16, 3, 64)
    ops = cpu_ops.load()
    with pytest.raises(RuntimeError, match="outside the rotary table"):
        ops.rope_write_kv(qkv, torch.tensor([16]), rotary.cos, rotary.sin, 9, 3, cache, cache.clone(), torch.tensor([0]))
    with pytest.raises(RuntimeError, match="outside the cache"):
        ops.rope_write_kv(qkv, torch.tensor([3]), rotary.cos, rotary.sin, 9, 3, cache, cache.clone(), torch.tensor([32]))


@pytest.mark.parametrize("bf16_out", [False, True])
def test_silu_mul_matches_reference(bf16_out):
    gate_up = torch.randn(11, 2 * 1536, generator=torch.Generator().manual_seed(2)) * 4
    out = cpu_ops.load().silu_mul(gate_up, bf16_out)
    ref = F.silu(gate_up[:, :1536]) * gate_up[:, 1536:]
    tol = 1e-2 if bf16_out else 2e-6
    torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol)
    assert torch.equal(cpu_ops.load().silu_mul(gate_up[3:4], bf16_out), out[3:4])


@pytest.mark.parametrize("quantization,tol", [(None, 1e-4), ("gguf", 0.1)])
def test_engine_with_fused_cpu_ops_matches_the_torch_ops(quantization, tol):
    """Greedy tokens equal, logprobs within rounding: float32 for dense weights; for packed ones the 4-bit
    kernel rounds every matmul output to bfloat16 (logits ~20 carry steps of 0.06-0.125), and a one-ulp
    change of a normed input can move a later bfloat16 rounding by a step."""
    from onecat.engine import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=1)
    prompts = ["The capital of France is", "def fibonacci(n):"]
    runs = {}
    for fused in (True, False):
        with LLM(EMBEDDED, dtype="float32", quantization=quantization, fused_kernels=fused, max_model_len=512) as llm:
            assert llm.info()["fused_kernels"] is fused
            assert llm.info()["fused_kernels_detail"]["kind"] == "cpu"
            runs[fused] = llm.generate(prompts, params)
    for a, b in zip(runs[True], runs[False]):
        assert a.token_ids == b.token_ids
        gaps = [abs(la[t] - lb[t]) for la, lb, t in zip(a.logprobs, b.logprobs, a.token_ids)]
        assert max(gaps) < tol


def test_bfloat16_model_keeps_the_torch_ops_and_says_why():
    from onecat.engine import LLM

    with LLM(EMBEDDED, dtype="bfloat16", max_model_len=256) as llm:
        detail = llm.info()["fused_kernels_detail"]
    assert detail["used"] is False and "float32" in detail["reason"]
