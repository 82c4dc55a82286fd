"""Fused Triton kernels (GPU only; skipped without CUDA + Triton): each one against the torch
reference ops it replaces, and the whole engine with fused kernels on vs off."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from gpu_kernels import half_tolerance, require_fused_kernels

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _fused():
    from onecat.engine.kernels import triton_fused

    require_fused_kernels()
    return triton_fused


def _close(a, b, dtype):
    tol = half_tolerance(dtype)
    assert torch.allclose(a.float(), b.float(), rtol=tol, atol=tol), (a.float() - b.float()).abs().max()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows,n", [(1, 4096), (7, 576), (33, 5120)])
@pytest.mark.parametrize("zero_centered", [False, True])
def test_add_rmsnorm_matches_reference(dtype, rows, n, zero_centered):
    """Llama's RMSNorm, and Qwen3.5's zero-centered one: the decoder layers' (with the residual) and the per-head
    q/k norms (a strided view, as q sits beside its gate)."""
    from onecat.engine.layers import hybrid_kernels
    from onecat.engine.layers.norm import RMSNorm
    from onecat.engine.layers.qwen3_5_norms import ZeroCenteredRMSNorm

    fused = _fused()
    eps = 1e-6 if zero_centered else 1e-5
    norm = (ZeroCenteredRMSNorm if zero_centered else RMSNorm)(n, eps).to("cuda", dtype)
    torch.nn.init.normal_(norm.weight, 0.0 if zero_centered else 1.0, 0.2)
    x = torch.randn(rows, n, device="cuda", dtype=dtype)
    r = torch.randn(rows, n, device="cuda", dtype=dtype) * 4
    ref_out, ref_res = norm(x, r)  # use_fused is off: the torch reference
    out, res = fused.add_rmsnorm(x, r, norm.weight, eps, zero_centered=zero_centered)
    assert torch.equal(res, ref_res)  # the residual add is one rounding either way
    _close(out, ref_out, dtype)
    _close(fused.add_rmsnorm(x, None, norm.weight, eps, zero_centered=zero_centered), norm(x), dtype)
    if not zero_centered:
        return
    heads = torch.randn(rows, 4, 2 * n, device="cuda", dtype=dtype)[..., :n]
    fused_heads = fused.add_rmsnorm(heads, None, norm.weight, eps, zero_centered=True)
    _close(fused_heads, norm(heads), dtype)
    norm.use_fused, enabled = True, hybrid_kernels.ENABLED
    try:  # the layer itself takes the kernel when the hybrid kernels are on
        hybrid_kernels.ENABLED = True
        assert torch.equal(norm(heads), fused_heads)
    finally:
        hybrid_kernels.ENABLED = enabled


@pytest.mark.parametrize("fp8", [None, torch.float8_e4m3fn, torch.float8_e5m2])
def test_gated_attention_kernels_match_reference(fp8):
    """Qwen3.5-27B's attention heads (24 query, 4 KV, 256 wide, RoPE on the first 64): q, the cache rows (bytes
    and scales where fp8) and the sigmoid gate against GatedAttention's torch ops, in bf16."""
    from onecat.engine.cache.kv import allocate_kv_caches, write_kv
    from onecat.engine.config import ModelConfig
    from onecat.engine.kernels import triton_gated_attention as ga
    from onecat.engine.layers.gated_attention import GatedAttention
    from onecat.engine.layers.rotary import RotaryEmbedding
    from onecat.engine.random_models import shape_config

    require_fused_kernels()
    dev, dtype = torch.device("cuda"), torch.bfloat16
    if ga.unsupported_reason(256, 64, fp8, dev):
        pytest.skip(ga.unsupported_reason(256, 64, fp8, dev))
    torch.manual_seed(0)
    cfg = ModelConfig.from_hf(dict(shape_config("tiny-qwen3.5"), head_dim=256, num_attention_heads=24,
                                   num_key_value_heads=4))
    rot = RotaryEmbedding(64, cfg.rope_theta, 4096, cfg.rope_scaling)
    attn = GatedAttention(cfg, 0, rot)
    for p in attn.parameters():
        p.data.normal_(0, 0.3)
    attn = attn.to(dev, dtype)
    H, Hkv, d, T = 24, 4, 256, 9
    qkv = torch.randn(T, 2 * H * d + 2 * Hkv * d, device=dev, dtype=dtype) * 2
    positions = torch.tensor([0, 1, 5, 77, 300, 1000, 2047, 3000, 4095], device=dev)
    slots = torch.randperm(64, device=dev)[:T]
    caches = [allocate_kv_caches(1, 8, 8, Hkv, d, dtype, fp8, dev)[0] for _ in range(2)]
    qg, k, v = qkv.split([2 * H * d, Hkv * d, Hkv * d], dim=-1)
    qg = qg.view(T, H, 2 * d)
    want_q = attn._rope(positions, attn.q_norm(qg[..., :d]))
    write_kv(caches[0], attn._rope(positions, attn.k_norm(k.view(T, Hkv, d))), v.view(T, Hkv, d), slots)
    q = ga.qk_norm_rope_cache(qkv, positions, rot.cos, rot.sin, H, Hkv, d, attn.q_norm.weight, attn.k_norm.weight,
                              attn.q_norm.eps, caches[1], slots)
    _close(q, want_q, dtype)
    if fp8 is None:
        _close(caches[1].k, caches[0].k, dtype)
        assert torch.equal(caches[1].v, caches[0].v)
    else:
        for name in ("k", "v"):
            got, want = (getattr(c, name).view(fp8).float() for c in caches)
            assert (got != want).float().mean() < 0.01, name  # a cast of the same value: equal but near ties
            _close(getattr(caches[1], name + "_scale"), getattr(caches[0], name + "_scale"), dtype)
    o = torch.randn(T, H, d, device=dev, dtype=dtype)
    _close(ga.sigmoid_gate(o, qkv, H, d), o.reshape(T, H * d) * torch.sigmoid(qg[..., d:].reshape(T, H * d)), dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_silu_mul_matches_reference(dtype):
    fused = _fused()
    gu = torch.randn(5, 2 * 3000, device="cuda", dtype=dtype) * 3
    gate, up = gu.split(3000, dim=-1)
    _close(fused.silu_mul(gu), F.silu(gate) * up, dtype)


@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("heads", [(32, 8, 128), (9, 3, 64)])
def test_qk_rope_cache_matches_reference(qk_norm, heads):
    from onecat.engine.cache.kv import allocate_kv_caches, write_kv
    from onecat.engine.layers.norm import RMSNorm
    from onecat.engine.layers.rotary import RotaryEmbedding

    fused = _fused()
    hq, hkv, d = heads
    dtype, dev, T, bs = torch.float16, torch.device("cuda"), 11, 16
    rot = RotaryEmbedding(d, 500000.0, 4096, {"rope_type": "llama3", "factor": 8.0,
                                              "original_max_position_embeddings": 1024})
    rot.build_tables(dev)
    qn, kn = RMSNorm(d, 1e-6).to(dev, dtype), RMSNorm(d, 1e-6).to(dev, dtype)
    torch.nn.init.normal_(qn.weight, 1.0, 0.3)
    torch.nn.init.normal_(kn.weight, 1.0, 0.3)
    qkv = torch.randn(T, (hq + 2 * hkv) * d, device=dev, dtype=dtype)
    positions = torch.tensor([0, 1, 5, 17, 100, 1023, 1024, 2047, 3000, 4000, 4095], device=dev)
    slots = torch.randperm(8 * bs, device=dev)[:T] + bs  # avoid the null block
    ref_cache, fused_cache = (allocate_kv_caches(1, 9, bs, hkv, d, dtype, None, dev)[0] for _ in range(2))

    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    q, k, v = q.reshape(T, hq, d), k.reshape(T, hkv, d), v.reshape(T, hkv, d)
    if qk_norm:
        q, k = qn(q), kn(k)
    q_ref, k_ref = rot(positions, q, k)
    write_kv(ref_cache, k_ref, v, slots)

    work = qkv.clone()
    fused.qk_rope_cache(work, positions, rot.cos, rot.sin, hq, hkv, d, fused_cache.k, fused_cache.v, slots,
                        qn.weight if qk_norm else None, kn.weight if qk_norm else None, 1e-6)
    _close(work[:, :hq * d].view(T, hq, d), q_ref, dtype)
    _close(fused_cache.k, ref_cache.k, dtype)
    assert torch.equal(fused_cache.v, ref_cache.v)  # v is copied, not computed


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_engine_with_fused_kernels_matches_without(tmp_path, arch):
    """Scores (per-token logprobs) fused on vs off agree to fp16 rounding, on a small random model;
    greedy generation runs through the fused path in full. (Greedy tokens are not compared: on
    random weights near-tied logits flip under any rounding change.)"""
    from tiny_models import make_tiny_model

    from onecat.engine import LLM, SamplingParams

    _fused()
    path = make_tiny_model(arch, tmp_path)
    prompts = [[(i * 37 + j * 11) % 300 + 3 for j in range(n)] for i, n in enumerate((5, 40, 130))]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    outs, scores = {}, {}
    for on in (True, False):
        llm = LLM(str(path), dtype="float16", device="cuda", fused_kernels=on, max_model_len=512,
                  kv_cache_memory_gb=0.2)
        assert llm.info()["fused_kernels"] is on
        outs[on] = [o.token_ids for o in llm.generate(prompts, params)]
        scores[on] = torch.tensor(llm.score(prompts)[2].logprobs)
    assert [len(o) for o in outs[True]] == [24] * 3
    assert (scores[True] - scores[False]).abs().max() < 0.05
