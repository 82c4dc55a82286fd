"""Gated DeltaNet on CUDA through flash-linear-attention (engine/kernels/fla_gated_delta.py; skipped without
CUDA or fla): the chunked and recurrent forms against the torch reference ops (Qwen3.5-27B's head
layout: 16 key heads, 48 value heads, 128 dims), and tiny Qwen3.5 / Qwen3.5-MoE models through the engine on
CUDA against transformers."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from onecat.engine.layers import gated_deltanet_ops as ops

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

HK, HV, D = 16, 48, 128
TOL = {torch.bfloat16: 2e-2, torch.float32: 2e-3}  # fla's float32 dots may run as tf32


def _fla():
    from onecat.engine.kernels import fla_gated_delta

    reason = fla_gated_delta.unavailable_reason(torch.empty(1, device="cuda"))
    if reason:
        pytest.skip(reason)
    return fla_gated_delta


def _inputs(n: int, dtype, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=g, device="cuda")

    q, k, v = rnd(n, HK, D).to(dtype), rnd(n, HK, D).to(dtype), rnd(n, HV, D).to(dtype)
    decay = -torch.exp(rnd(HV) * 0.3) * F.softplus(rnd(n, HV))  # log decays <= 0, some near 0
    beta = torch.sigmoid(rnd(n, HV))
    return q, k, v, decay, beta


def _rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n", [1, 37, 200])
def test_chunk_matches_reference(dtype, n):
    fla = _fla()
    q, k, v, decay, beta = _inputs(n, dtype, n)
    state = torch.randn(HV, D, D, device="cuda") * 0.1
    out, new_state = fla.chunk(q, k, v, decay, beta, state)
    qr, kr = ops.prepare_qk(q.float(), k.float(), HV)  # the chunked reference works in float32
    ref_out, ref_state = ops.chunk_gated_delta_rule(qr.transpose(0, 1), kr.transpose(0, 1), v.float().transpose(0, 1),
                                                    decay.T, beta.T, state)
    assert out.shape == (n, HV, D) and new_state.shape == (HV, D, D) and new_state.dtype == torch.float32
    assert _rel(out, ref_out.transpose(0, 1)) < TOL[dtype]
    assert _rel(new_state, ref_state) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_recurrent_step_matches_reference(dtype):
    fla = _fla()
    B = 5
    q, k, v, decay, beta = _inputs(B, dtype, 7)
    states = torch.randn(B, HV, D, D, device="cuda") * 0.1
    out, new = fla.recurrent_step(q, k, v, decay, beta, states)
    qr, kr = ops.prepare_qk(q.double(), k.double(), HV)
    ref_out, ref_new = ops.recurrent_gated_delta_step(qr, kr, v.double(), decay.double(), beta.double(), states.double())
    assert _rel(out, ref_out) < TOL[dtype] and _rel(new, ref_new) < TOL[dtype]


def test_chunks_then_steps_equal_one_chunk():
    """A prompt in two chunks then two one-token steps continues the state as one chunk over all of it."""
    fla = _fla()
    q, k, v, decay, beta = _inputs(100, torch.float32, 3)
    zero = torch.zeros(HV, D, D, device="cuda")
    whole, whole_state = fla.chunk(q, k, v, decay, beta, zero)
    a, s = fla.chunk(q[:61], k[:61], v[:61], decay[:61], beta[:61], zero)
    b, s = fla.chunk(q[61:98], k[61:98], v[61:98], decay[61:98], beta[61:98], s)
    outs = [a, b]
    s = s.unsqueeze(0)
    for t in (98, 99):
        o, s = fla.recurrent_step(q[t:t + 1], k[t:t + 1], v[t:t + 1], decay[t:t + 1], beta[t:t + 1], s)
        outs.append(o)
    assert _rel(torch.cat(outs), whole) < 2e-3 and _rel(s[0], whole_state) < 2e-3


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5_moe"])
def test_engine_on_cuda_matches_transformers(tmp_path, arch):
    """float32, teacher forced. The mixers' outputs are scaled up and the DeltaNet decays made slow, so the logits
    depend on the carried state: on CPU, a state scaled by 0.9 at each decode step moves them by 0.06, a decay
    dropped by 0.02, against 1e-6 for the correct engine."""
    _fla()
    from tests.moe_hybrid_gpu_check import compare_with_transformers
    from tests.tiny_moe_hybrid import make_tiny_moe_hybrid

    d = make_tiny_moe_hybrid(arch, tmp_path / arch, mixer_gain=10.0, slow_decay=True, linear_num_key_heads=HK,
                             linear_num_value_heads=HV, linear_key_head_dim=D, linear_value_head_dim=D)
    paths = compare_with_transformers(d, lambda m: None, atol=5e-3)
    assert "fla" in paths and "torch" not in paths and "loop" not in paths


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5_moe"])
def test_engine_bf16_on_cuda_matches_transformers(tmp_path, arch):
    """bf16 with Qwen3.5-27B's heads (DeltaNet 16 / 48 of 128, attention 24 q / 4 kv of 256): the kernels the
    benchmark runs (fla in bf16, the Triton paged decode at head_dim 256, GQA group 6) against transformers'
    float32 logprobs on the engine's own tokens. bf16 rounding alone gives about 7e-3 on CPU; a greedy token
    only has to be within the tolerance of transformers' top one, so a near-tie may flip it."""
    _fla()
    from tests.moe_hybrid_gpu_check import compare_with_transformers
    from tests.tiny_moe_hybrid import make_tiny_moe_hybrid

    d = make_tiny_moe_hybrid(arch, tmp_path / arch, mixer_gain=10.0, slow_decay=True, linear_num_key_heads=HK,
                             linear_num_value_heads=HV, linear_key_head_dim=D, linear_value_head_dim=D,
                             num_attention_heads=24, num_key_value_heads=4, head_dim=256)
    report = {}
    paths = compare_with_transformers(d, lambda m: None, atol=5e-2, dtype="bfloat16", report=report)
    assert paths == {"fla"} or (arch == "qwen3_5_moe" and paths == {"fla", "triton_dot"}), paths
    if torch.cuda.get_device_capability()[0] >= 8:
        assert set(report["attention_calls"]) == {"TRITON_PAGED"}, report
