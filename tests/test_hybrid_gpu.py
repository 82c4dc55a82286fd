"""Gated DeltaNet on CUDA through flash-linear-attention (engine/kernels/fla_gated_delta.py; skipped without
CUDA or fla): CUDA graphs of hybrid decode steps against the eager engine (first: they are the quickest to
reach), the chunked and recurrent forms against the torch reference ops (Qwen3.5-27B's head layout: 16 key
heads, 48 value heads, 128 dims), and tiny Qwen3.5 / Qwen3.5-MoE models through the engine on CUDA against
transformers."""
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


# ---- CUDA graphs of hybrid decode steps (engine/worker/cuda_graph.py) against the eager engine -----------------
# Qwen3.5-27B's DeltaNet and attention heads (the benchmark's kernels), mixers scaled up and decays slowed so the
# logits lean on the recurrent state (tests/tiny_moe_hybrid.py); bf16, where the Triton paged decode runs and
# the step is graph-safe
GRAPH_MODEL = dict(mixer_gain=10.0, slow_decay=True, linear_num_key_heads=HK, linear_num_value_heads=HV,
                   linear_key_head_dim=D, linear_value_head_dim=D, num_attention_heads=24, num_key_value_heads=4,
                   head_dim=256)
GRAPH_PROMPTS = [[5, 17, 99, 3], list(range(10, 47)), [200, 7], list(range(300, 319))]
# two bf16 runs whose schedules differ (preemption points, recomputed prefixes) differ by bf16 rounding as a bf16
# run does from float32 (test_engine_bf16_on_cuda_matches_transformers' tolerance)
SCHEDULE_TOL = 5e-2


def _params(n: int = 12, logprobs: int | None = 5):
    from onecat.engine import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=logprobs)


def _agree(a, b, tol: float, strict: bool = False) -> float:
    """The largest logprob difference of two runs' outputs (top-5 tokens both have) up to where their texts part;
    they may part only at a near-tie (each pick within tol of the other's in both runs), never if `strict`."""
    worst = 0.0
    for x, y in zip(a, b):
        assert len(x.token_ids) == len(y.token_ids)
        for i, (tx, ty) in enumerate(zip(x.token_ids, y.token_ids)):
            if x.logprobs is not None:
                shared = set(x.logprobs[i]) & set(y.logprobs[i])
                assert tx in shared and ty in shared, (i, x.logprobs[i], y.logprobs[i])
                worst = max([worst] + [abs(x.logprobs[i][t] - y.logprobs[i][t]) for t in shared])
            if tx != ty:
                assert not strict, f"tokens part at step {i}: {x.token_ids} vs {y.token_ids}"
                assert x.logprobs is not None, f"greedy tokens part at step {i}: {x.token_ids} vs {y.token_ids}"
                assert abs(x.logprobs[i][tx] - x.logprobs[i][ty]) <= tol
                assert abs(y.logprobs[i][tx] - y.logprobs[i][ty]) <= tol
                break
    assert worst <= tol, worst
    return worst


def _graph_runs(model_dir, runs, **settings) -> dict:
    """{mode: (outputs of each run, cuda graph report, engine)} with cuda_graph off and full, the same settings."""
    from onecat.engine import LLM

    out = {}
    for mode in ("off", "full"):
        with LLM(str(model_dir), dtype="bfloat16", device="cuda", cuda_graph=mode, max_num_seqs=4, **settings) as llm:
            results = [llm.generate(prompts, params) for prompts, params in runs]
            report = llm.cuda_graph_report()
            facts = {"info_graph": llm.info()["cuda_graph"], "pipeline_launches": llm.engine.pipeline.launches
                     if llm.engine.pipeline is not None else 0, "states": llm.model.states,
                     "preemptions": llm.engine.scheduler.num_preemptions,
                     "paths": {m.path for m in llm.model.modules() if hasattr(m, "use_fla")},
                     "warmup": llm.info()["warmup"], "built": llm.info()["kernel_variants_built_after_warmup"]}
            out[mode] = (results, report, facts)
    print({mode: out[mode][1] for mode in out})
    return out


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5_moe"])
def test_cuda_graphs_replay_hybrid_decode_steps(tmp_path, arch):
    """Decode steps replay captured graphs (DeltaNet state rows gathered and scattered by the slot indices of the
    graph's static buffer, fla's recurrent kernel inside) and give the eager engine's tokens and logprobs: a
    batch of 4 (captured size 4, logprobs: each step through the runner), 3 (size 4 with one padded row on the
    scratch slot), two one-token prompts (their first step is a decode step from zeroed slots) and greedy
    without logprobs (the one-step-ahead pipeline replays)."""
    _fla()
    from tests.tiny_moe_hybrid import make_tiny_moe_hybrid

    d = make_tiny_moe_hybrid(arch, tmp_path / arch, **GRAPH_MODEL)
    runs = [(GRAPH_PROMPTS, _params()), (GRAPH_PROMPTS[:3], _params()), ([[42], [7]], _params()),
            (GRAPH_PROMPTS, _params(logprobs=None))]
    got = _graph_runs(d, runs, enable_prefix_caching=False)
    (eager, _, _), (graphs, report, facts) = got["off"], got["full"]
    assert facts["info_graph"] is True and report["used"] and report["disabled_reason"] is None, report
    assert {1, 2, 4} <= set(report["captured_sizes"]) and report["replays"] >= 3 * 11, report
    assert report["verify_disabled_reason"] is None and facts["pipeline_launches"] > 0, (report, facts)
    assert facts["paths"] == {"fla"}
    worst = [_agree(graphs[0], eager[0], TOL[torch.bfloat16], strict=True)]  # no padding: the same kernels
    worst += [_agree(g, e, TOL[torch.bfloat16]) for g, e in zip(graphs[1:3], eager[1:3])]
    assert [o.token_ids for o in graphs[3]] == [o.token_ids for o in graphs[0]]  # pipeline == runner replays
    assert [o.token_ids for o in eager[3]] == [o.token_ids for o in eager[0]]
    print(f"{arch}: graphs vs eager, worst logprob difference per run {worst}")


def test_cuda_graphs_keep_prefix_hits_preemption_and_rollback(tmp_path):
    """With graphs on: mamba_cache_mode align with too little KV for the batch (requests preempted, resumed from
    saved states) and a repeat of the prompts (prefix hits restore saved states, then decode steps replay), and
    n-gram speculation (verify steps replay graphs whose rows put each request's own tokens behind padding; the
    step after rejected drafts rolls the slot back first, recomputing its state from the row's kept inputs);
    each against the eager engine with the same settings."""
    _fla()
    from tests.tiny_moe_hybrid import make_tiny_moe_hybrid

    d = make_tiny_moe_hybrid("qwen3_5", tmp_path / "qwen3_5", **GRAPH_MODEL)
    prompts = [list(range(10, 47)), [5, 17, 99, 3], list(range(100, 160)), list(range(300, 319))]
    got = _graph_runs(d, [(prompts, _params(16)), (prompts[:2], _params(16))], enable_prefix_caching=True,
                      mamba_cache_mode="align", block_size=16, num_kv_blocks=9, max_num_batched_tokens=32,
                      max_model_len=96)
    (eager, _, _), (graphs, report, facts) = got["off"], got["full"]
    assert report["replays"] > 0 and facts["preemptions"] > 0 and facts["states"].restored > 0, (report, facts)
    for g, e in zip(graphs, eager):
        _agree(g, e, SCHEDULE_TOL)
    spec = [[5, 6, 7, 8] * 6, list(range(10, 47)), [9, 10, 11] * 5 + [9]]
    # every step drafts: the engine's gate would stop drafting once it timed the tiny model's rounds as slower than
    # its plain steps (on an H100 it did: 4 verify replays, no rejected draft, no rollback to check)
    got = _graph_runs(d, [([p], _params(24)) for p in spec], enable_prefix_caching=False,
                      speculative_config={"method": "ngram", "num_speculative_tokens": 3, "disable_when_slower": False})
    (eager, _, _), (graphs, report, facts) = got["off"], got["full"]
    assert report["replays"] > 0 and report["verify_replays"] > 0 and facts["states"].rollbacks > 0, (report, facts)
    for g, e in zip(graphs, eager):
        _agree(g, e, SCHEDULE_TOL)


def test_hybrid_verify_steps_replay_narrower_widths(tmp_path, monkeypatch):
    """A proposer whose requests draft fewer than k by their acceptance (synthetic at acceptance 2.5 with a DFlash
    drafter's compute, k = 7): the hybrid model's verify steps replay graphs of narrower widths (2, 4, 8) on its
    one set of trail buffers, rollbacks recompute from the rows' kept inputs; tokens and logprobs those of the
    eager engine."""
    _fla()
    from onecat.engine.worker import cuda_graph
    from tests.tiny_moe_hybrid import make_tiny_moe_hybrid

    monkeypatch.setattr(cuda_graph, "HYBRID_NARROW_VERIFY", True)
    d = make_tiny_moe_hybrid("qwen3_5", tmp_path / "qwen3_5", **GRAPH_MODEL)
    spec = {"method": "synthetic", "num_speculative_tokens": 7, "acceptance_length": 2.5, "compute": "dflash",
            "disable_when_slower": False}
    run = (GRAPH_PROMPTS[:3], _params(40))
    got = _graph_runs(d, [run, run], enable_prefix_caching=False, speculative_config=spec)  # learns, then drafts
    (eager, _, _), (graphs, report, facts) = got["off"], got["full"]
    assert report["verify_replays"] > 0 and facts["states"].rollbacks > 0, (report, facts)
    assert len(report["captured_verify_widths"]) > 1 and report["verify_disabled_reason"] is None, report
    for g, e in zip(graphs, eager):
        _agree(g, e, SCHEDULE_TOL)
    # the eager engine verified rows of every draft length, at widths padded to 2, 4, 8: built at start-up
    eager_facts = got["off"][2]
    assert eager_facts["warmup"]["verify_row_widths_built"] == 3, eager_facts["warmup"]
    assert "rows_recurrence_kernel" not in eager_facts["built"]["by_kernel"], eager_facts["built"]


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
    assert paths == {"fla"} or (arch == "qwen3_5_moe" and paths == {"fla", "triton_dot", "triton_gemv"}), paths
    # (qwen3_5_moe: prefill steps of more than triton_moe_gemv.MAX_TOKENS tokens take the grouped GEMM)
    if torch.cuda.get_device_capability()[0] >= 8:
        assert set(report["attention_calls"]) == {"TRITON_PAGED"}, report
