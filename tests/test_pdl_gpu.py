"""Programmatic dependent launch (engine/kernels/pdl.py): the decode kernels give the same bits with PDL on
and off, when each kernel reads what the kernel just before it wrote (a wait in the wrong place would read
stale memory), eagerly and inside a CUDA graph, and a greedy decode through the engine keeps every token.
The on/off comparisons need SM90+ (PDL is off below it); the CPU test checks the launch options."""
from __future__ import annotations

import pytest
import torch

from onecat.engine.kernels import pdl

CUDA = torch.cuda.is_available()
SM90 = CUDA and torch.cuda.get_device_capability()[0] >= 9
needs_sm90 = pytest.mark.skipif(not SM90, reason="PDL needs an SM90+ CUDA GPU")


def test_pdl_is_off_on_cpu_and_when_disabled(monkeypatch):
    assert pdl.options(torch.device("cpu")) == {"PDL": False}
    monkeypatch.setattr(pdl, "ENABLED", False)
    assert pdl.options(torch.device("cuda", 0)) == {"PDL": False}


def _chain(x, ws, norm_w, residual):
    """Each kernel consumes the previous one's output: GEMVs (with the norm and the GLU folded in), add +
    RMSNorm, SiLU * mul, the fused router, the fused experts and the argmax."""
    from onecat.engine.kernels import triton_fused as tf
    from onecat.engine.kernels import triton_gemv as tg
    from onecat.engine.kernels import triton_moe as tm
    from onecat.engine.kernels import triton_router as tr

    y, h = tg.gemv(x, ws["a"], residual=residual, norm_weight=norm_w, eps=1e-6)
    y = tg.gemv(y, ws["b"])
    n, h2 = tf.add_rmsnorm(y, h, norm_w, 1e-6)
    g = tg.gemv(n, ws["glu"], residual=h2, norm_weight=norm_w, eps=1e-6, glu=True)[0]
    s = tf.silu_mul(tg.gemv(g, ws["gu"]))
    logits = tg.gemv(s, ws["router"])
    weights, ids = tr.route(logits, 4, True)
    out = tm.fused_experts(s, ws["experts_gu"], ws["experts_down"], weights, ids)
    return torch.stack([y.float().flatten()[:64], out.float().flatten()[:64]]), tf.argmax_rows(out)


def _weights(hidden=1024, inter=512, experts=16, dtype=torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(0)

    def rnd(*shape):
        return (torch.randn(*shape, generator=g, device="cuda") * shape[-1] ** -0.5).to(dtype)

    return {"a": rnd(hidden, hidden), "b": rnd(hidden, hidden), "glu": rnd(2 * hidden, hidden),
            "gu": rnd(2 * hidden, hidden), "router": rnd(experts, hidden),
            "experts_gu": rnd(experts, 2 * inter, hidden), "experts_down": rnd(experts, hidden, inter)}


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("graph", [False, True])
def test_kernel_chain_same_bits_with_and_without_pdl(monkeypatch, rows, graph):
    ws = _weights()
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(rows, 1024, generator=g, device="cuda").to(torch.bfloat16)
    residual = torch.randn(rows, 1024, generator=g, device="cuda").to(torch.bfloat16)
    norm_w = (torch.rand(1024, generator=g, device="cuda") + 0.5).to(torch.bfloat16)
    results = {}
    for on in (False, True):
        monkeypatch.setattr(pdl, "ENABLED", on)
        if graph:
            _chain(x, ws, norm_w, residual)  # compile outside the capture
            torch.cuda.synchronize()
            cg = torch.cuda.CUDAGraph()
            with torch.cuda.graph(cg):
                out = _chain(x, ws, norm_w, residual)
            for _ in range(3):
                cg.replay()
            torch.cuda.synchronize()
            results[on] = (out[0].clone(), out[1].clone())
        else:
            results[on] = _chain(x, ws, norm_w, residual)
    assert torch.equal(results[True][0], results[False][0])
    assert torch.equal(results[True][1], results[False][1])


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_engine_greedy_tokens_same_with_and_without_pdl(tmp_path, monkeypatch, arch):
    from onecat.engine import LLM, SamplingParams

    if arch == "llama":
        from tests.tiny_models import make_tiny_model

        model_dir = make_tiny_model("llama", tmp_path / "m", hidden_size=256, num_attention_heads=8,
                                    num_key_value_heads=2)
    else:
        from tests.tiny_moe_hybrid import make_tiny_moe_hybrid

        model_dir = make_tiny_moe_hybrid("qwen3_moe", tmp_path / "m")
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=1)
    prompts = ["t1 t2 t3 t4 t5", "t9 t8 t7", "t3 t3 t3 t3 t3 t3 t3 t3 t3 t3 t3"]
    results = {}
    for on in (False, True):
        monkeypatch.setattr(pdl, "ENABLED", on)
        llm = LLM(str(model_dir), device="cuda", dtype="bfloat16", cuda_graph=True, max_model_len=512,
                  max_num_batched_tokens=1024, seed=0, kv_cache_memory_gb=1.0)
        try:
            outs = llm.generate(prompts, params) + llm.generate(prompts[0], params)
            results[on] = [(o.token_ids, [float(lp[t]) for lp, t in zip(o.logprobs, o.token_ids)]) for o in outs]
            assert llm.cuda_graph_report()["replays"] > 0
        finally:
            llm.close()
    assert results[True] == results[False]


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("fmt,dtype", [("int4", torch.float16), ("nvfp4", torch.bfloat16), ("fp8", torch.bfloat16)])
@pytest.mark.parametrize("splits", [1, 2])
def test_packed_gemv_chain_same_bits_with_and_without_pdl(monkeypatch, fmt, dtype, splits):
    """The tensor-core packed GEMV (csrc/quant_gemv/mma_gemv.cuh) between Triton kernels, each reading the output
    of the one before; with splits 2 the blocks also pass partials and tickets."""
    from onecat.engine.kernels import triton_fused as tf
    from onecat.engine.kernels.quant_gemv import EXTENSION
    from tests.test_quant_gemv_gpu import make, run

    reason = EXTENSION.prerequisites_missing()
    if reason:
        pytest.skip(reason)
    layers = [make(fmt, 1024, 1024, seed)[0] for seed in range(3)]
    g = torch.Generator(device="cuda").manual_seed(2)
    x = torch.randn(1, 1024, generator=g, device="cuda").to(dtype)
    norm_w = (torch.rand(1024, generator=g, device="cuda") + 0.5).to(dtype)

    def chain():
        h = x
        for args in layers:
            h = tf.add_rmsnorm(run(h, fmt, args, splits=splits, kernel="mma"), None, norm_w, 1e-6)
        return h

    results = {}
    for on in (False, True):
        monkeypatch.setattr(pdl, "ENABLED", on)
        eager = chain()
        torch.cuda.synchronize()
        cg = torch.cuda.CUDAGraph()
        with torch.cuda.graph(cg):
            out = chain()
        cg.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)
        results[on] = eager
    assert torch.equal(results[True], results[False])
