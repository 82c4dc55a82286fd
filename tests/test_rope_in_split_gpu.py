"""A pure decode step's q/k norm, RoPE and K/V store inside the paged decode's split kernel
(`ONECAT_ROPE_IN_SPLIT`, `paged_decode(new=...)`) on a GPU: the attention output and the cache bit for bit as
qk_rope_cache followed by paged_decode, eagerly and replayed in a CUDA graph, each row's bits alone as in the
batch; and an engine decoding with it gives the tokens and logprobs of one without it. GPU only; the same
kernel's logic runs under Triton's interpreter in tests/test_rope_in_split_interpret.py."""
from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available()
                                                  or torch.cuda.get_device_capability() < (8, 0),
                                                  reason="TRITON_PAGED needs a CUDA GPU of SM80+")]


@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("heads", [(32, 8, 128), (9, 3, 64)], ids=["8b", "embedded"])
def test_split_kernel_rotates_as_qk_rope_cache_does(qk_norm, heads):
    from onecat.engine.kernels import triton_paged_decode as tpd
    from onecat.engine.kernels.triton_fused import qk_rope_cache
    from onecat.engine.layers.rotary import RotaryEmbedding
    from tests.test_gpu_engine import CASES, _paged_case, _replayed

    hq, hkv, d = heads
    dt = torch.bfloat16
    _, cache0, meta = _paged_case([1] * 8, CASES[0][1], hq, hkv, d, 16, None, dt, seed=11)
    t = meta.seq_lens.numel()
    gen = torch.Generator(device="cuda").manual_seed(11)
    qkv0 = torch.randn(t, (hq + 2 * hkv) * d, generator=gen, device="cuda").to(dt)
    rot = RotaryEmbedding(d, 10000.0, 4096, None)
    rot.build_tables(torch.device("cuda"))
    qw = (1 + 0.1 * torch.randn(d, generator=gen, device="cuda")).to(dt) if qk_norm else None
    kw = (1 + 0.1 * torch.randn(d, generator=gen, device="cuda")).to(dt) if qk_norm else None
    positions = (meta.seq_lens - 1).long()
    k0, v0 = cache0.k.clone(), cache0.v.clone()

    def step(fused: bool, rows=slice(None)):
        cache0.k.copy_(k0)
        cache0.v.copy_(v0)
        qkv = qkv0[rows].clone()
        n = qkv.shape[0]
        lens, tables, slots = meta.seq_lens[rows], meta.block_tables[rows], meta.slot_mapping[rows]
        pos = positions[rows]
        out = torch.empty(n, hq, d, dtype=dt, device="cuda")
        new = None
        if fused:
            new = tpd.NewTokens(qkv[:, hq * d:], pos, rot.cos, rot.sin, slots, qw, kw, 1e-6)
        else:
            qk_rope_cache(qkv, pos, rot.cos, rot.sin, hq, hkv, d, cache0.k, cache0.v, slots, qw, kw, 1e-6)
        tpd.paged_decode(out, qkv[:, :hq * d].view(n, hq, d), cache0, tables, lens, meta.max_seq_len, d ** -0.5,
                         new=new)
        return out

    want = step(False)
    want_k, want_v = cache0.k.clone(), cache0.v.clone()
    got = step(True)
    assert torch.equal(cache0.k, want_k) and torch.equal(cache0.v, want_v)
    assert torch.isfinite(want).all() and torch.equal(got, want)
    assert torch.equal(_replayed(lambda: step(True)), want)
    assert torch.equal(step(True, slice(5, 6))[0], want[5])  # a row's bits do not depend on its batch


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_engine_decodes_the_same_with_rope_in_split(tmp_path, monkeypatch, arch):
    from onecat.engine import LLM, SamplingParams
    from onecat.engine.attention import triton_paged
    from onecat.engine.kernels import triton_paged_decode as tpd
    from tests.test_gpu_engine import PROMPTS
    from tests.tiny_models import make_tiny_model

    model_dir = make_tiny_model(arch, tmp_path / arch, hidden_size=256, num_attention_heads=8, num_key_value_heads=2)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=0)
    fused_calls = []
    plain = tpd.paged_decode

    def counted(*a, **kw):
        fused_calls.append(kw.get("new") is not None)
        return plain(*a, **kw)

    monkeypatch.setattr(tpd, "paged_decode", counted)
    results = {}
    for on in (False, True):
        monkeypatch.setattr(triton_paged, "ROPE_IN_SPLIT", on)
        fused_calls.clear()
        llm = LLM(str(model_dir), device="cuda", dtype="bfloat16", cuda_graph=True, max_model_len=512, seed=0,
                  max_num_batched_tokens=1024, kv_cache_memory_gb=1.0)
        try:
            outs = llm.generate(PROMPTS, params)
            results[on] = [(o.token_ids, [lp[t] for lp, t in zip(o.logprobs, o.token_ids)]) for o in outs]
        finally:
            llm.close()
        assert any(fused_calls) is on  # the graphs were captured through the path under test
    assert results[True] == results[False]
