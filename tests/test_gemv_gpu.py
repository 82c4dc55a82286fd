"""Batch-1 Triton GEMV and the greedy argmax (GPU only; skipped without CUDA + Triton): against
torch for odd shapes, bias, both half dtypes, the folded norm and SiLU*mul against the separate
kernels, rows of a multi-row call equal to the row alone, the routing of Linear (one row, or the rows a
step allows), and decode logprobs through the GEMV against a
prefill score of the same tokens."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from gpu_kernels import half_tolerance, require_fused_kernels

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _gemv():
    from onecat.engine.kernels import triton_gemv

    require_fused_kernels()
    return triton_gemv


def _close(y, ref, dtype):
    tol = half_tolerance(dtype)
    err = float((y.float() - ref.float()).abs().max() / ref.float().abs().max())
    assert err < tol, err


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n,k,bias", [(4096, 4096, False), (1000, 576, True), (6144, 4096, True),
                                      (130, 14336, False), (49152, 960, False)])
def test_gemv_matches_linear(dtype, n, k, bias):
    tg = _gemv()
    w = torch.randn(n, k, device="cuda", dtype=dtype) * k ** -0.5
    b = torch.randn(n, device="cuda", dtype=dtype) if bias else None
    x = torch.randn(1, k, device="cuda", dtype=dtype)
    ref = F.linear(x.float(), w.float(), None if b is None else b.float())
    y = tg.gemv(x, w, b)
    assert y.shape == (1, n) and y.dtype == dtype
    _close(y, ref, dtype)
    for cfg in [(1, 2048, 8), (16, 256, 4), (2, 512, 4)]:
        _close(tg.gemv(x, w, b, config=cfg), ref, dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("k,glu,bias", [(576, False, True), (4096, False, False), (4096, True, False),
                                        (896, True, True)])
def test_norm_and_glu_match_separate_kernels(dtype, k, glu, bias):
    """RMSNorm(x + residual) folded in front (and SiLU(gate) * up behind, for a [gate | up] weight)."""
    from onecat.engine.layers.norm import RMSNorm

    tg = _gemv()
    n = 1536
    norm = RMSNorm(k, 1e-6).to("cuda", dtype)
    torch.nn.init.normal_(norm.weight, 1.0, 0.2)
    w = torch.randn(n, k, device="cuda", dtype=dtype) * k ** -0.5
    b = torch.randn(n, device="cuda", dtype=dtype) if bias else None
    x, r = torch.randn(1, k, device="cuda", dtype=dtype), torch.randn(1, k, device="cuda", dtype=dtype) * 4
    ref_x, ref_h = norm(x, r)  # torch reference ops (use_fused off)
    ref = F.linear(ref_x.float(), w.float(), None if b is None else b.float())
    if glu:
        ref = F.silu(ref[:, :n // 2]) * ref[:, n // 2:]
    for cfg in [None, (4, 512, 4), (1, 1024, 8)]:
        y, h = tg.gemv(x, w, b, residual=r, norm_weight=norm.weight, eps=1e-6, glu=glu, config=cfg)
        assert torch.equal(h, ref_h)  # the residual add is one rounding either way
        assert y.shape == (1, n // 2 if glu else n)
        _close(y, ref, dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("k,rows", [(2048, 1), (4096, 3), (896, 2)])
def test_normed_out_is_the_add_rmsnorm_kernels_output(dtype, k, rows):
    """normed_out (the MoE router's GEMV hands the normed input to the experts): the same y and x + residual
    as without it, and the normed input of the add_rmsnorm kernel (the RMS statistic is summed in another
    order: within one rounding step), each row as it is alone."""
    from onecat.engine.kernels import triton_fused as tf

    tg = _gemv()
    w = torch.randn(128, k, device="cuda", dtype=dtype) * k ** -0.5
    nw = (torch.randn(k, device="cuda") * 0.2 + 1).to(dtype)
    x, r = torch.randn(rows, k, device="cuda", dtype=dtype), torch.randn(rows, k, device="cuda", dtype=dtype) * 4
    y, h, normed = tg.gemv(x, w, residual=r, norm_weight=nw, eps=1e-6, normed_out=True)
    y0, h0 = tg.gemv(x, w, residual=r, norm_weight=nw, eps=1e-6)
    assert torch.equal(y, y0) and torch.equal(h, h0)
    ref, ref_h = tf.add_rmsnorm(x, r, nw, 1e-6)
    assert torch.equal(h, ref_h)
    step = ref.float().abs() * (2 ** -7 if dtype == torch.bfloat16 else 2 ** -10)
    assert bool(((normed.float() - ref.float()).abs() <= step).all())
    assert float((normed.float() - ref.float()).abs().mean()) < float(step.mean()) * 0.1  # mostly equal
    for m in range(rows):
        one = tg.gemv(x[m:m + 1], w, residual=r[m:m + 1], norm_weight=nw, eps=1e-6, normed_out=True)
        assert all(torch.equal(a[m], b[0]) for a, b in zip((y, h, normed), one))
    with pytest.raises(ValueError, match="normed_out"):
        tg.gemv(x, w, normed_out=True)


@pytest.mark.parametrize("row_loop", [False, True])
@pytest.mark.parametrize("norm,glu", [(False, False), (True, False), (True, True)])
def test_each_row_of_a_multi_row_call_equals_that_row_alone(monkeypatch, norm, glu, row_loop):
    """Batch invariance: row m of an M-row call is bit for bit the single-row result (what lets a
    batch-1 verify step reproduce batch-1 decode), with one program per row or programs that walk every
    row of their tile; and more rows than MAX_ROWS are refused."""
    tg = _gemv()
    monkeypatch.setattr(tg, "ROW_LOOP", row_loop)
    k, n, rows = 576, 1536, 8
    w = torch.randn(n, k, device="cuda", dtype=torch.float16) * k ** -0.5
    nw = torch.randn(k, device="cuda", dtype=torch.float16) * 0.2 + 1
    x, r = torch.randn(rows, k, device="cuda", dtype=torch.float16), torch.randn(rows, k, device="cuda",
                                                                                  dtype=torch.float16)
    extra = dict(residual=r, norm_weight=nw, eps=1e-6, glu=glu) if norm else {}
    many = tg.gemv(x, w, **extra)
    for m in range(rows):
        one = tg.gemv(x[m:m + 1], w, **({**extra, "residual": r[m:m + 1]} if norm else {}))
        if norm:
            assert torch.equal(many[0][m], one[0][0]) and torch.equal(many[1][m], one[1][0])
        else:
            assert torch.equal(many[m], one[0])
    too_many = torch.randn(tg.MAX_ROWS + 1, k, device="cuda", dtype=torch.float16)
    assert tg.gemv_unsupported_reason(too_many, w) is not None


def test_a_step_context_lets_more_rows_take_the_gemv():
    from onecat.engine.attention.forward_context import ForwardContext, set_forward_context
    from onecat.engine.layers.linear import Linear

    _gemv()
    lin = Linear(256, 320, bias=False).to("cuda", torch.float16)
    lin.use_fused = True
    x = torch.randn(8, 256, device="cuda", dtype=torch.float16)
    assert not lin.gemv_ok(x)
    set_forward_context(ForwardContext(None, [], None, gemv_rows=8))
    try:
        assert lin.gemv_ok(x) and not lin.gemv_ok(torch.randn(9, 256, device="cuda", dtype=torch.float16))
        assert torch.equal(lin(x)[3], lin(x[3:4])[0])
    finally:
        set_forward_context(None)
    assert not lin.gemv_ok(x)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_argmax_rows_matches_torch(dtype):
    from onecat.engine.kernels.triton_fused import argmax_rows

    _gemv()
    logits = torch.randn(5, 151936, device="cuda").to(dtype)
    logits[1, 77] = logits[1, 150000] = 50.0  # a tie: the first index wins, as in torch
    logits[2, -1] = 60.0  # the last entry, in the last partial block
    logits[3] = float("-inf")
    logits = logits[:, :128256]  # a strided view
    assert torch.equal(argmax_rows(logits), logits.float().argmax(dim=-1))
    assert argmax_rows(logits[:0]).shape == (0,)


def test_linear_routes_only_single_rows():
    from onecat.engine.layers.linear import Linear, norm_then_linear
    from onecat.engine.layers.norm import RMSNorm

    tg = _gemv()
    lin = Linear(256, 320, bias=True).to("cuda", torch.float16)
    one, many = torch.randn(1, 256, device="cuda", dtype=torch.float16), torch.randn(5, 256, device="cuda",
                                                                                      dtype=torch.float16)
    assert not lin.gemv_ok(one)  # fused kernels off by default
    lin.use_fused = True
    assert lin.gemv_ok(one) and not lin.gemv_ok(many) and not lin.gemv_ok(one.float())
    assert tg.gemv_unsupported_reason(one[:, ::2], lin.weight[:, :128]) is not None
    _close(lin(one), F.linear(one.float(), lin.weight.float(), lin.bias.float()), torch.float16)
    assert lin(many).shape == (5, 320)
    norm = RMSNorm(256, 1e-5).to("cuda", torch.float16)
    r = torch.randn(1, 256, device="cuda", dtype=torch.float16)
    ref_x, ref_h = norm(one, r)  # the norm's own (torch) path
    y, h = norm_then_linear(norm, lin, one, r)
    assert torch.equal(h, ref_h)
    _close(y, F.linear(ref_x.float(), lin.weight.float(), lin.bias.float()), torch.float16)
    assert norm_then_linear(norm, lin, many, many)[0].shape == (5, 320)
    act = lambda t: F.silu(t[..., :160]) * t[..., 160:]  # noqa: E731
    y, _ = norm_then_linear(norm, lin, one, r, silu_mul=act)
    _close(y, act(F.linear(ref_x.float(), lin.weight.float(), lin.bias.float())), torch.float16)
    assert norm_then_linear(norm, lin, many, many, silu_mul=act)[0].shape == (5, 160)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_decode_logprobs_through_gemv_match_prefill_scores(tmp_path, arch):
    """Batch-1 greedy decode (every projection a GEMV, graphs on) reports per-token logprobs that a
    fused-off engine's prefill scoring of the same tokens (cuBLAS GEMMs) reproduces."""
    from tiny_models import make_tiny_model

    from onecat.engine import LLM, SamplingParams

    _gemv()
    path = make_tiny_model(arch, tmp_path)
    prompt = [(j * 37) % 300 + 3 for j in range(40)]
    kw = dict(dtype="float16", device="cuda", max_model_len=512, kv_cache_memory_gb=0.2)
    llm = LLM(str(path), **kw)
    out = llm.generate([prompt], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=0))[0]
    decoded = torch.tensor([lp[t] for lp, t in zip(out.logprobs, out.token_ids)])
    # without logprobs the one-step-ahead pipeline runs, picking tokens with the Triton argmax
    again = llm.generate([prompt], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))[0]
    assert again.token_ids == out.token_ids
    del llm
    ref = LLM(str(path), fused_kernels=False, **kw)
    scored = torch.tensor(ref.score([prompt + out.token_ids])[0].logprobs[len(prompt) - 1:])
    assert decoded.shape == scored.shape == (24,)
    assert (decoded - scored).abs().max() < 0.05
