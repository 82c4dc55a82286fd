"""Fused MoE on CUDA (engine/kernels/triton_moe.py, triton_moe_gemv.py; skipped without CUDA + Triton): both
grouped variants (tensor-core `dot`, SM70-safe `fma`) and the decode GEMVs against the per-expert loop on the
same weights in float64, at decode and prefill pair counts, skewed routing included; a token's bits in any
decode batch; and a tiny Qwen3-MoE through the engine on CUDA against transformers."""
from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-5}


def _require():
    from onecat.engine.kernels.triton_support import moe_unavailable_reason

    reason = moe_unavailable_reason(torch.empty(1, device="cuda"))
    if reason:
        pytest.skip(reason)


def _experts(E, H, I, dtype):
    from onecat.engine.layers.moe import Experts

    ex = Experts(E, H, I).to("cuda", dtype)
    torch.nn.init.normal_(ex.gate_up_proj, std=H ** -0.5)
    torch.nn.init.normal_(ex.down_proj, std=I ** -0.5)
    return ex


def _check(ex, x, weights, ids, variant):
    """Relative L2 error of the fused variant against the float64 loop (poisoned output must all be written)."""
    ref_ex = _experts(*ex.gate_up_proj.shape[::2], ex.intermediate, torch.float64)
    ref_ex.gate_up_proj.data.copy_(ex.gate_up_proj)
    ref_ex.down_proj.data.copy_(ex.down_proj)
    ref = ref_ex._loop(x.double(), weights.double(), ids)
    from onecat.engine.kernels.triton_moe import takes_gemv

    ex.variant = variant
    got = ex(x, weights, ids)
    assert ex.path == ("triton_gemv" if takes_gemv(x.shape[0]) else f"triton_{variant}")
    assert torch.isfinite(got).all()
    err = ((got.double() - ref).norm() / ref.norm()).item()
    assert err < TOL[x.dtype], (variant, x.dtype, err)
    return got


@pytest.mark.parametrize("variant,dtype,tokens", [
    ("dot", torch.bfloat16, 1), ("dot", torch.bfloat16, 16), ("dot", torch.bfloat16, 17), ("dot", torch.bfloat16, 100),
    ("dot", torch.bfloat16, 3000), ("dot", torch.float16, 33), ("dot", torch.float32, 33), ("dot", torch.float32, 5),
    ("fma", torch.bfloat16, 1), ("fma", torch.bfloat16, 100), ("fma", torch.float32, 33)])
@pytest.mark.parametrize("gemv", [True, False])
def test_fused_matches_per_expert_loop(monkeypatch, variant, dtype, tokens, gemv):
    """Up to triton_moe_gemv.MAX_TOKENS tokens the decode GEMVs run (gemv=True), else the grouped GEMM; with the
    switch off the grouped GEMM takes those small batches too."""
    _require()
    from onecat.engine.kernels import triton_moe

    monkeypatch.setattr(triton_moe, "DECODE_GEMV", gemv)
    E, H, I, k = 16, 256, 96, 4  # I not a multiple of the column tile: masked columns
    torch.manual_seed(tokens)
    ex = _experts(E, H, I, dtype)
    x = torch.randn(tokens, H, device="cuda", dtype=dtype)
    probs = torch.softmax(torch.randn(tokens, E, device="cuda"), -1)
    weights, ids = probs.topk(k, dim=-1)
    _check(ex, x, weights.to(dtype), ids, variant)


@pytest.mark.parametrize("variant", ["dot", "fma"])
def test_skewed_routing_and_idle_experts(variant):
    """Most tokens on one expert (many row blocks of it), half the experts idle."""
    _require()
    E, H, I, k, T = 32, 128, 64, 2, 257
    ex = _experts(E, H, I, torch.bfloat16)
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    ids = torch.stack([torch.full((T,), 5), torch.randint(0, E // 2, (T,))], 1).to("cuda")
    ids[::7, 1] = 6
    weights = torch.softmax(torch.randn(T, k, device="cuda"), -1).to(torch.bfloat16)
    _check(ex, x, weights, ids, variant)


@pytest.mark.parametrize("graph", [False, True])
def test_a_token_gets_the_same_bits_in_any_decode_batch(graph):
    """The decode GEMVs compute each (token, expert) pair alone: each token alone, and in a batch of 5, gives its
    row of a 16-token batch to the bit, eagerly and replayed from a CUDA graph. Pairs share experts here (32
    experts, 16 x 8 pairs) and the widths are not multiples of the tiles."""
    _require()
    from onecat.engine.kernels import triton_moe, triton_moe_gemv

    E, H, I, k, T = 32, 320, 96, 8, triton_moe_gemv.MAX_TOKENS
    torch.manual_seed(3)
    ex = _experts(E, H, I, torch.bfloat16)
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    weights, ids = torch.softmax(torch.randn(T, E, device="cuda"), -1).topk(k, dim=-1)
    weights = weights.to(torch.bfloat16)

    def run(xs, ws, es):
        return triton_moe.fused_experts(xs, ex.gate_up_proj, ex.down_proj, ws, es)

    batch = run(x, weights, ids)
    for rows in (slice(0, 1), slice(13, 14), slice(15, 16), slice(3, 8)):
        part = (x[rows].clone(), weights[rows].clone(), ids[rows].clone())
        if graph:
            run(*part)
            torch.cuda.synchronize()
            cg = torch.cuda.CUDAGraph()
            with torch.cuda.graph(cg):
                got = run(*part)
            for _ in range(3):
                cg.replay()
            torch.cuda.synchronize()
        else:
            got = run(*part)
        assert torch.equal(got, batch[rows]), rows


def test_forced_variant_errors_are_clear():
    _require()
    ex = _experts(4, 32, 16, torch.bfloat16)
    ex.variant = "wmma"
    x = torch.randn(2, 32, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="choose one of dot, fma"):
        ex(x, torch.ones(2, 1, device="cuda", dtype=torch.bfloat16), torch.zeros(2, 1, dtype=torch.long, device="cuda"))


@pytest.mark.parametrize("variant", ["dot", "fma"])
def test_engine_on_cuda_matches_transformers(tmp_path, variant):
    """A tiny Qwen3-MoE in float32 on CUDA (prefill chunked over steps, ragged batch, greedy decode) against
    transformers' float32 logits on the same tokens."""
    _require()
    from tests.moe_hybrid_gpu_check import compare_with_transformers
    from tests.tiny_moe_hybrid import make_tiny_moe_hybrid

    d = make_tiny_moe_hybrid("qwen3_moe", tmp_path / "m")
    paths = compare_with_transformers(d, lambda m: setattr(m, "variant", variant) if hasattr(m, "variant") else None,
                                      atol=2e-4)
    assert paths == {f"triton_{variant}", "triton_gemv"}  # prefill steps of 24 tokens, decode steps of 5


def test_cuda_graphs_replay_the_eager_tokens(tmp_path):
    """A tiny Qwen3-MoE in bf16 with cuda_graph full: decode steps replay captured graphs (routing and the decode
    GEMVs inside) and give the eager engine's greedy tokens."""
    _require()
    from onecat.engine import LLM, SamplingParams
    from tests.tiny_moe_hybrid import make_tiny_moe_hybrid

    d = make_tiny_moe_hybrid("qwen3_moe", tmp_path / "m")
    prompts = [[5, 17, 99, 3], list(range(10, 47)), [200, 7], list(range(300, 319))]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    tokens = {}
    for mode in ("off", "full"):
        with LLM(str(d), dtype="bfloat16", device="cuda", enable_prefix_caching=False, cuda_graph=mode,
                 max_num_seqs=8) as llm:
            # all prompts prefill in one step, so decode steps run at captured sizes (4, then 1)
            tokens[mode] = ([o.token_ids for o in llm.generate(prompts, params)],
                            llm.generate(prompts[1], params)[0].token_ids)
            report = llm.cuda_graph_report()
            assert llm.info()["cuda_graph"] is (mode == "full"), report
            if mode == "full":
                assert report["replays"] > 0 and {1, 4} <= set(report["captured_sizes"]), report
    assert tokens["full"] == tokens["off"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("experts,top_k,renorm", [(128, 8, True), (128, 8, False), (60, 4, True), (512, 10, True)])
def test_fused_router_matches_a_float64_route(dtype, experts, top_k, renorm):
    """The one-kernel router (engine/kernels/triton_router.py) against the route computed in float64 from the
    same logits: its k experts are a top k (logits in bf16/fp16 tie often, and either of two equal experts is
    right), largest first; its weights are those experts' (renormalized) probabilities rounded to the model
    dtype, within one step of it (fp32: 4e-6 relative, the kernel's exp); the torch route agrees on the weights
    wherever it chose the same experts; and a token's result is the same alone or in a batch (from the same logits)."""
    _require()
    from onecat.engine.kernels.triton_router import route
    from onecat.engine.layers.moe import SparseMoE

    torch.manual_seed(experts + top_k)
    moe = SparseMoE(64, 32, experts, top_k, renorm).to("cuda", dtype)
    x = torch.randn(37, 64, device="cuda", dtype=dtype)
    logits = moe.gate(x)
    torch_w, torch_ids = moe.route(x)  # the torch ops
    moe.use_fused = True
    w, ids = moe.route(x)
    assert w.dtype == torch.float32 and ids.dtype == torch.int32
    assert torch.equal(w.to(dtype).float(), w)  # values of the model dtype
    probs = torch.softmax(logits.double(), dim=-1)
    chosen = probs.gather(1, ids.long())
    unchosen = probs.scatter(1, ids.long(), -1.0).max(dim=1).values
    assert (chosen.min(dim=1).values >= unchosen * (1 - 4e-6)).all()  # a top k
    assert (chosen[:, :-1] >= chosen[:, 1:] * (1 - 4e-6)).all()  # largest first
    ref = chosen / chosen.sum(dim=1, keepdim=True) if renorm else chosen
    step = 4e-6 if dtype == torch.float32 else torch.finfo(dtype).eps
    assert ((w.double() - ref).abs() <= step * ref + 1e-12).all()
    same = (ids.long() == torch_ids).all(dim=1)
    assert same.any()
    assert ((w[same] - torch_w[same].float()).abs() <= step * torch_w[same].float().abs() + 1e-12).all()
    all_w, all_ids = route(logits, top_k, renorm)  # the kernel alone: the gate GEMM's bits may vary with M
    alone_w, alone_ids = route(logits[5:6], top_k, renorm)
    assert torch.equal(alone_w, all_w[5:6]) and torch.equal(alone_ids, all_ids[5:6])


def test_fused_router_sends_ties_to_the_lower_expert():
    _require()
    from onecat.engine.kernels.triton_router import route

    w, ids = route(torch.zeros(2, 16, device="cuda", dtype=torch.bfloat16), 4, True)
    assert ids.tolist() == [[0, 1, 2, 3]] * 2 and torch.equal(w, torch.full((2, 4), 0.25, device="cuda"))
    with pytest.raises(ValueError, match="top_k <= num_experts"):
        route(torch.zeros(1, 4, device="cuda"), 5, True)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "w4a16"])
def test_packed_experts_are_routed_on_the_device_and_graphs_replay(tmp_path, fmt):
    """A tiny Qwen3-MoE quantized at load (experts packed): steps of few tokens take the routed GEMV (no host
    read of the routing), so decode steps replay CUDA graphs, with the eager engine's greedy tokens (both run
    the same kernels)."""
    _require()
    from onecat.engine import LLM, SamplingParams
    from tests.tiny_moe_hybrid import make_tiny_moe_hybrid

    d = make_tiny_moe_hybrid("qwen3_moe", tmp_path / "m", hidden_size=128, moe_intermediate_size=64,
                             intermediate_size=128)
    prompts = [[5, 17, 99, 3], list(range(10, 47)), [200, 7]]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    tokens = {}
    for mode in ("off", "full"):
        with LLM(str(d), dtype="bfloat16", device="cuda", enable_prefix_caching=False, cuda_graph=mode,
                 quantization=fmt, max_num_seqs=4) as llm:
            tokens[mode] = [o.token_ids for o in llm.generate(prompts, params)]
            experts = [m for m in llm.model.modules() if type(m).__name__ == "PackedExperts"]
            assert experts and all(m.routed is not None and m.path == "routed" for m in experts)
            report = llm.cuda_graph_report()
            if mode == "full":
                assert report["replays"] > 0 and report["disabled_reason"] is None, report
    assert tokens["full"] == tokens["off"]


@pytest.mark.parametrize("arch,fmt", [("qwen3_moe", "nvfp4"), ("qwen3_moe", "w4a16"), ("qwen3_5_moe", "nvfp4")])
def test_fused_routed_experts_match_the_separate_kernels_and_replay_in_graphs(tmp_path, arch, fmt, monkeypatch):
    """ONECAT_MOE_FUSED_ROUTED's two kernels (SiLU * mul in the gate/up kernel, the weighted top-k sum and, on the
    Qwen3.5 MoE, the gated shared expert in the down kernel): each packed MoE layer's output within bf16 rounding
    of the separate kernels', and decode steps replayed from CUDA graphs give the eager engine's greedy tokens
    (the same kernels)."""
    _require()
    from onecat.engine import LLM, SamplingParams
    from onecat.engine.layers.moe import PackedExperts
    from tests.tiny_moe_hybrid import make_tiny_moe_hybrid

    extra = {"shared_expert_intermediate_size": 64} if arch == "qwen3_5_moe" else {"intermediate_size": 128}
    d = make_tiny_moe_hybrid(arch, tmp_path / "m", hidden_size=128, moe_intermediate_size=64, **extra)
    prompts = [[5, 17, 99, 3], list(range(10, 47)), [200, 7]]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    monkeypatch.setattr(PackedExperts, "FUSED", True)
    tokens = {}
    for mode in ("off", "full"):
        with LLM(str(d), dtype="bfloat16", device="cuda", enable_prefix_caching=False, cuda_graph=mode,
                 quantization=fmt, max_num_seqs=4) as llm:
            tokens[mode] = [o.token_ids for o in llm.generate(prompts, params)]
            if mode == "full":
                assert llm.cuda_graph_report()["replays"] > 0
            moe = next(m for m in llm.model.modules() if type(m).__name__ == "SparseMoE")
            assert isinstance(moe.experts, PackedExperts) and moe.experts.routes_on_device(
                torch.zeros(1, 128, device="cuda", dtype=torch.bfloat16))
            x = torch.randn(5, 128, device="cuda", dtype=torch.bfloat16)
            with torch.inference_mode():
                fused = moe(x)  # router, experts (and shared expert) as a decode step runs them
                monkeypatch.setattr(PackedExperts, "FUSED", False)
                separate = moe(x)
                monkeypatch.setattr(PackedExperts, "FUSED", True)
            assert (fused.float() - separate.float()).abs().max() <= 0.02 * separate.float().abs().max() + 1e-3
    assert tokens["full"] == tokens["off"]
