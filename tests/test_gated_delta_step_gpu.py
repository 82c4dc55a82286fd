"""The fused Gated DeltaNet decode and verify steps (engine/kernels/triton_gated_delta_step.py,
ONECAT_FUSED_HYBRID=1, with the hybrid's other fused kernels) on a GPU: at Qwen3.5-27B's DeltaNet widths against
the layer's torch path on the same inputs and cache, and engines whose decode and verify steps replay CUDA
graphs with them against engines without them (greedy, logprobs; n-gram speculation with rejections, so
rolled-back slots are recomputed from the fused step's trails)."""
from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

HK, HV, D = 16, 48, 128  # Qwen3.5-27B's DeltaNet heads
TOL = {torch.bfloat16: 2e-2, torch.float16: 2e-3}


def _triton():
    from onecat.engine.kernels.triton_support import fused_unavailable_reason

    reason = fused_unavailable_reason()
    if reason:
        pytest.skip(reason)


def _layer_and_caches(dtype, count: int = 2):
    """A DeltaNet layer at the route widths (random weights) and `count` caches holding the same random state."""
    from onecat.engine.cache.recurrent_state import RecurrentStateCache
    from onecat.engine.config import ModelConfig
    from onecat.engine.layers.gated_deltanet import GatedDeltaNet, delta_rows, linear_attention_sizes
    from onecat.engine.random_models import shape_config

    torch.manual_seed(0)
    raw = dict(shape_config("tiny-qwen3.5"), hidden_size=256, linear_num_key_heads=HK, linear_num_value_heads=HV,
               linear_key_head_dim=D, linear_value_head_dim=D)
    cfg = ModelConfig.from_hf(raw)
    layer = GatedDeltaNet(cfg, state_index=0)
    for p in layer.parameters():
        p.data.normal_(0, 0.1)
    layer.A_log.data.uniform_(-2, 0)
    layer = layer.to("cuda", dtype)
    layer.use_fla = False
    s = linear_attention_sizes(cfg)
    caches = [RecurrentStateCache(1, 4, s["conv_dim"], s["conv_kernel"], HV, D, D, dtype, torch.device("cuda"),
                                  k_heads=HK, recurrence=delta_rows) for _ in range(count)]
    conv, ssm = torch.randn_like(caches[0].conv), torch.randn_like(caches[0].ssm) * 0.1
    for c in caches:
        c.conv.copy_(conv)
        c.ssm.copy_(ssm)
    return cfg, layer, caches


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("width", [4, 16])
def test_split_verify_gives_the_step_kernels_bits(dtype, width, monkeypatch):
    """The verify step in three kernels (triton_gated_delta_verify.py, ONECAT_GDN_SPLIT_VERIFY=1) against `step`
    walking the rows on the same inputs and cache: out_proj's input, the states and convolution inputs
    left in the slots and every trail buffer, bit for bit (the same arithmetic; a verify row's own tokens keep the
    decode steps' bits either way)."""
    _triton()
    from onecat.engine.kernels import triton_gated_delta_verify as split_kernels

    cfg, layer, caches = _layer_and_caches(dtype)
    slots, lead = torch.tensor([2, 0, 3], device="cuda"), torch.tensor([0, 1, width - 2], device="cuda")
    x = torch.randn(3 * width, cfg.hidden_size, device="cuda", dtype=dtype)
    outs = []
    with torch.no_grad():
        for split, cache in zip((True, False), caches):
            monkeypatch.setattr(split_kernels, "SPLIT_VERIFY", split)
            outs.append(layer.fused_step(layer.in_proj(x), cache.verify_plan(slots, lead, width)))
    assert torch.equal(outs[0], outs[1]), float((outs[0].float() - outs[1].float()).abs().max())
    assert torch.equal(caches[0].ssm, caches[1].ssm) and torch.equal(caches[0].conv, caches[1].conv)
    for name in ("pre_ssm", "conv", "k", "v", "g", "beta"):
        a, b = getattr(caches[0].verify_trails, name)[0, slots], getattr(caches[1].verify_trails, name)[0, slots]
        assert torch.equal(a, b), name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("width", [1, 16])
@pytest.mark.parametrize("apart", [False, True])
def test_fused_step_matches_the_torch_path_at_the_route_widths(dtype, rows, width, apart):
    """A decode step (width 1) or a verify step of rows of 16 tokens (padded rows: leads 0, 5, 12); `apart`:
    in_proj stored in two parts (q|k|v|z, b|a), whose outputs the fused step reads where they lie."""
    _triton()
    cfg, layer, caches = _layer_and_caches(dtype)
    slots = torch.tensor([2, 0, 3][:rows], device="cuda")
    lead = torch.tensor([0, 5, 12][:rows], device="cuda")
    plans = [c.decode_plan(slots) if width == 1 else c.verify_plan(slots, lead, width) for c in caches]
    x = torch.randn(rows * width, cfg.hidden_size, device="cuda", dtype=dtype)
    with torch.no_grad():
        seen = []
        project = layer.out_proj.forward
        layer.out_proj.forward = lambda t: seen.append(t) or project(t)
        layer(x, plans[0])
        if apart:
            from onecat.engine.quant.row_split import RowSplitLinear

            whole, split = layer.in_proj, layer.conv_dim + layer.value_size
            parts = [torch.nn.Linear(whole.in_features, n, bias=False, device="cuda", dtype=dtype)
                     for n in (split, 2 * HV)]
            parts[0].weight.copy_(whole.weight[:split])
            parts[1].weight.copy_(whole.weight[split:])
            layer.in_proj = RowSplitLinear(parts)
            projected, gates = layer._project_apart(x)
            assert gates is not None and gates.shape == (x.shape[0], 2 * HV)
            got = layer.fused_step(projected, plans[1], gates=gates)
        else:
            got = layer.fused_step(layer.in_proj(x), plans[1])
    own = torch.cat([torch.arange(r * width + int(lead[r]) * (width > 1), (r + 1) * width) for r in range(rows)])
    got, want = got[own.cuda()], seen[0][own.cuda()]
    err = ((got.double() - want.double()).norm() / want.double().norm()).item()
    ssm_err = ((caches[1].ssm - caches[0].ssm).norm() / caches[0].ssm.norm()).item()
    if width > 1:
        t0, t1 = caches[0].verify_trails, caches[1].verify_trails
        assert torch.equal(t1.pre_ssm, t0.pre_ssm) and torch.equal(t1.conv, t0.conv)
        for name in ("k", "v", "g", "beta"):
            a, b = getattr(t1, name)[0, slots], getattr(t0, name)[0, slots]
            assert ((a.double() - b.double()).norm() / b.double().norm()).item() < TOL[dtype], name
    print(f"{dtype} rows={rows} width={width}: relative error {err:.2e}, state {ssm_err:.2e}, "
          f"bit-equal {torch.equal(got, want)}")
    assert err < TOL[dtype] and ssm_err < TOL[dtype]
    assert torch.equal(caches[1].conv, caches[0].conv)  # the carried-over inputs move, never computed


@pytest.mark.parametrize("speculative,quantization", [(False, None), (True, None), (False, "nvfp4")])
def test_graphs_with_the_fused_step_give_the_engine_without_it(tmp_path, monkeypatch, speculative, quantization):
    """Graph-replayed decode (and verify) steps through the fused kernels (padded rows on the scratch slot
    included) against the same engine on the torch path: tokens equal up to a near-tie, logprobs within bf16
    rounding; with speculation, the same tokens as plain decoding. NVFP4 quantized at load, as route 1 runs:
    in_proj in two parts (q|k|v|z packed, b|a dense), read apart by the fused step."""
    _triton()
    from onecat.engine import LLM
    from onecat.engine.layers import gated_deltanet, hybrid_kernels
    from tests.test_hybrid_gpu import GRAPH_MODEL, GRAPH_PROMPTS, SCHEDULE_TOL, _agree, _params
    from tests.tiny_moe_hybrid import make_tiny_moe_hybrid

    d = make_tiny_moe_hybrid("qwen3_5", tmp_path / "qwen3_5", **GRAPH_MODEL)
    spec = dict(speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                    "prompt_lookup_max": 2}) if speculative else {}
    outs, calls = {}, {False: 0, True: 0}
    fused_step = gated_deltanet.GatedDeltaNet.fused_step

    def counted(self, *args, **kwargs):  # graph replays run no Python: count the eager and captured calls
        calls[hybrid_kernels.ENABLED] += 1
        return fused_step(self, *args, **kwargs)

    monkeypatch.setattr(gated_deltanet.GatedDeltaNet, "fused_step", counted)
    for fused in (False, True):
        monkeypatch.setattr(hybrid_kernels, "ENABLED", fused)
        with LLM(str(d), dtype="bfloat16", device="cuda", cuda_graph="full", max_num_seqs=4,
                 enable_prefix_caching=False, quantization=quantization, **spec) as llm:
            layers = [m for m in llm.model.modules() if isinstance(m, gated_deltanet.GatedDeltaNet)]
            if quantization:
                assert all(hasattr(m.in_proj, "parts") for m in layers), "in_proj not stored in two parts"
            outs[fused] = [llm.generate(GRAPH_PROMPTS, _params()), llm.generate(GRAPH_PROMPTS[:3], _params())]
            assert llm.cuda_graph_report()["used"]
            detail = llm.info()["fused_kernels_detail"]["hybrid"]
            assert detail.startswith("fused:") == fused, detail
            if speculative:
                assert llm.cuda_graph_report()["verify_disabled_reason"] is None
    assert calls[True] > 0 and calls[False] == 0, calls
    worst = [_agree(a, b, SCHEDULE_TOL) for a, b in zip(outs[True], outs[False])]
    print(f"fused vs torch steps (speculative {speculative}): worst logprob difference per run {worst}")
