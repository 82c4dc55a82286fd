"""The fused Gated DeltaNet decode step (engine/kernels/triton_gated_delta_decode.py, ONECAT_FUSED_GDN_DECODE=1)
on a GPU: at Qwen3.5-27B's DeltaNet widths against the layer's torch path on the same inputs and cache, and an
engine whose decode steps replay CUDA graphs with it against the engine without it (greedy, logprobs)."""
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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 3])
def test_fused_decode_matches_the_torch_path_at_the_route_widths(dtype, rows):
    _triton()
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
                                  k_heads=HK, recurrence=delta_rows) for _ in range(2)]
    conv, ssm = torch.randn_like(caches[0].conv), torch.randn_like(caches[0].ssm) * 0.1
    for c in caches:
        c.conv.copy_(conv)
        c.ssm.copy_(ssm)
    slots = torch.tensor([2, 0, 3][:rows], device="cuda")
    x = torch.randn(rows, cfg.hidden_size, device="cuda", dtype=dtype)
    with torch.no_grad():
        seen = []
        project = layer.out_proj.forward
        layer.out_proj.forward = lambda t: seen.append(t) or project(t)
        layer(x, caches[0].decode_plan(slots))
        got = layer.fused_decode(layer.in_proj(x), caches[1].decode_plan(slots))
    want = seen[0]
    err = ((got.double() - want.double()).norm() / want.double().norm()).item()
    ssm_err = ((caches[1].ssm - caches[0].ssm).norm() / caches[0].ssm.norm()).item()
    print(f"{dtype} rows={rows}: relative error {err:.2e}, state {ssm_err:.2e}, bit-equal {torch.equal(got, want)}")
    assert err < TOL[dtype] and ssm_err < TOL[dtype]
    assert torch.equal(caches[1].conv, caches[0].conv)  # the carried-over inputs move, never computed


def test_graphs_with_the_fused_decode_give_the_engine_without_it(tmp_path, monkeypatch):
    """Graph-replayed decode steps through the fused kernels (padded rows on the scratch slot included) against
    the same engine on the torch path: tokens equal up to a near-tie, logprobs within bf16 rounding."""
    _triton()
    from onecat.engine import LLM
    from onecat.engine.layers import gated_deltanet
    from tests.test_hybrid_gpu import GRAPH_MODEL, GRAPH_PROMPTS, SCHEDULE_TOL, _agree, _params
    from tests.tiny_moe_hybrid import make_tiny_moe_hybrid

    d = make_tiny_moe_hybrid("qwen3_5", tmp_path / "qwen3_5", **GRAPH_MODEL)
    outs, paths = {}, {}
    for fused in (False, True):
        monkeypatch.setattr(gated_deltanet, "FUSED_DECODE", fused)
        with LLM(str(d), dtype="bfloat16", device="cuda", cuda_graph="full", max_num_seqs=4,
                 enable_prefix_caching=False) as llm:
            outs[fused] = [llm.generate(GRAPH_PROMPTS, _params()), llm.generate(GRAPH_PROMPTS[:3], _params())]
            paths[fused] = {m.path for m in llm.model.modules() if isinstance(m, gated_deltanet.GatedDeltaNet)}
            assert llm.cuda_graph_report()["used"]
            detail = llm.info()["fused_kernels_detail"]["gated_deltanet_decode"]
            assert detail.startswith("two fused kernels") == fused, detail
    assert "fused decode" in paths[True] and "fused decode" not in paths[False], paths
    worst = [_agree(a, b, SCHEDULE_TOL) for a, b in zip(outs[True], outs[False])]
    print(f"fused vs torch decode steps: worst logprob difference per run {worst}")
