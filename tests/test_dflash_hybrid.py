"""DFlash on the hybrid models (Qwen3.5, Qwen3.5-MoE: Gated DeltaNet + gated attention), on the tiny checkpoints in
tests/data, each with a random drafter made for it by the training code's drafter config.

The target taps the outputs of the drafter's layers (a DeltaNet layer, a gated-attention layer, the last) in its
prefill, decode and verify passes; a verify chunk runs the drafts token by token and rolls the recurrent state back
to the accepted ones, and only the accepted positions' rows reach the drafter. Checked: every row the drafter
receives equals transformers' layer outputs at that position, greedy output equals target-only, seeded sampling
keeps the target's law, and mamba_cache_mode align prefix hits give the tokens of no cache."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from scipy.stats import chisquare

from onecat.engine import LLM, SamplingParams
from onecat.engine.config import ModelConfig
from onecat.engine.errors import ConfigError
from tests.test_dflash_runtime import DraftChecker
from tests.test_hybrid_state import graph_like_decode  # noqa: F401  (a fixture: decode steps as graphs run them)
from tests.test_speculative import ALPHA, top_k_two_token_law

DATA = Path(__file__).parent / "data"
ARCHS = ["tiny-qwen35", "tiny-qwen35moe"]
TAPS = [0, 1, 3]  # layer_types: linear, full, linear, full: a DeltaNet layer, a gated-attention layer, the last
BLOCK = 5
PROMPTS = [[5, 6, 7, 8] * 6, list(range(10, 47)), [9, 10, 11] * 5 + [9], [100, 3]]


def greedy(n: int = 20) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def target_config(arch: str | Path) -> ModelConfig:
    return ModelConfig.from_hf(json.loads((DATA / arch / "config.json").read_text()))


def make_drafter(mc: ModelConfig, path: Path, seed: int) -> Path:
    """A drafter directory as training writes it for the target `mc`: config shaped like the target's attention,
    random weights (a MoE target has no dense MLP width to copy: the drafter's is given)."""
    from onecat.training.drafter import drafter_config, new_drafter
    from onecat.training.export import save_drafter

    cfg = drafter_config(mc, block_size=BLOCK, layer_ids=TAPS, num_layers=1,
                         intermediate_size=None if mc.intermediate_size else 48, mask_token_id=0)
    save_drafter(new_drafter(cfg, 256, torch.device("cpu"), seed=seed), cfg, path)
    return path


@pytest.fixture(scope="module")
def drafters(tmp_path_factory) -> dict[str, Path]:
    return {arch: make_drafter(target_config(arch), tmp_path_factory.mktemp("dflash") / arch, seed)
            for seed, arch in enumerate(ARCHS)}


def dflash(drafters, arch: str, k: int = BLOCK - 1) -> dict:
    """Drafting every step (no speed gate), so each run drafts the same rounds."""
    return {"method": "dflash", "num_speculative_tokens": k, "model": str(drafters[arch]), "disable_when_slower": False}


@pytest.fixture(scope="module")
def reference_tokens() -> dict[str, list[list[int]]]:
    out = {}
    for arch in ARCHS:
        with LLM(str(DATA / arch), dtype="float32", max_model_len=128) as llm:
            out[arch] = [o.token_ids for o in llm.generate(PROMPTS, greedy())]
    return out


def steer_drafts(proposer, prompts: list[list[int]], outputs: list[list[int]]) -> None:
    """After the drafter has drafted (and DraftChecker checked it), swap each greedy draft for target-only's next
    tokens with one wrong token at a place that moves from round to round: verify steps accept some drafts and
    reject the rest, so the recurrent state is rolled back inside verify chunks and accepted rows are kept. Every
    third call drops the drafts: those steps are plain decode steps."""
    by_prompt = {tuple(p): o for p, o in zip(prompts, outputs)}
    drafted, rounds, calls = proposer.propose, [0], [0]

    def propose(seqs, budgets):
        out = drafted(seqs, budgets)
        calls[0] += 1
        if calls[0] % 3 == 0:
            return [[]] * len(seqs)
        for i, (seq, draft) in enumerate(zip(seqs, out)):
            if len(draft) == 0 or not seq.params.greedy:
                continue
            n = seq.num_output_tokens
            right = by_prompt[tuple(seq.token_ids[:seq.num_prompt_tokens])][n:n + len(draft)]
            wrong_at = rounds[0] % (len(draft) + 2)  # past the end: every draft right
            out[i] = [t if j != wrong_at else t ^ 1 for j, t in enumerate(right)]  # t ^ 1: another token
            rounds[0] += 1
        return out

    proposer.propose = propose


# ---- the tap ----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def transformers_layers():
    """Per target, a function: token ids -> ([T, len(TAPS) * hidden] transformers' outputs of the TAPS layers,
    [T, hidden] its final normed hidden states)."""
    transformers = pytest.importorskip("transformers")
    fns = {}
    for arch in ARCHS:
        model = transformers.AutoModelForCausalLM.from_pretrained(str(DATA / arch), dtype=torch.float32).eval()

        def layer_outputs(ids: list[int], model=model) -> tuple[torch.Tensor, torch.Tensor]:
            seen = {}
            hooks = [model.model.layers[i].register_forward_hook(
                lambda mod, args, out, i=i: seen.__setitem__(i, out[0] if isinstance(out, tuple) else out))
                for i in TAPS]
            hooks.append(model.model.norm.register_forward_hook(lambda mod, args, out: seen.__setitem__("norm", out)))
            try:
                with torch.no_grad():
                    model(torch.tensor([ids]))
            finally:
                for h in hooks:
                    h.remove()
            return torch.cat([seen[i][0] for i in TAPS], dim=-1), seen["norm"][0]

        fns[arch] = layer_outputs
    return fns


def test_no_drafter_no_tap():
    """Without a drafter the model taps nothing (aux_layer_ids empty): aux_hidden stays None."""
    with LLM(str(DATA / "tiny-qwen35"), dtype="float32", max_model_len=64) as llm:
        llm.generate(PROMPTS[:2], greedy(3))
        assert llm.model.aux_layer_ids == [] and llm.model.aux_hidden is None


@pytest.mark.parametrize("decode", ["eager", "graph_like"])
@pytest.mark.parametrize("arch", ARCHS)
def test_rows_the_drafter_gets_are_the_target_layers_outputs(arch, decode, drafters, reference_tokens,
                                                             transformers_layers, request):
    """Prefill chunks, decode steps (eager, or through the CUDA-graph decode plan) and verify steps with partly
    accepted drafts: the drafter holds one row per computed position, and each equals transformers' outputs of the
    tapped layers there."""
    decode_steps = request.getfixturevalue("graph_like_decode") if decode == "graph_like" else None
    with LLM(str(DATA / arch), dtype="float32", max_model_len=128, max_num_batched_tokens=16,
             speculative_config=dflash(drafters, arch, k=3)) as llm:
        proposer = llm.engine.proposer.proposer
        assert llm.model.aux_layer_ids == TAPS
        checker = DraftChecker(proposer)
        steer_drafts(proposer, PROMPTS, reference_tokens[arch])
        outs = llm.generate(PROMPTS, greedy())
        assert llm.model.states.rollbacks > 0
    assert [o.token_ids for o in outs] == reference_tokens[arch]
    assert 0 < sum(o.spec.num_accepted_tokens for o in outs) < sum(o.spec.num_draft_tokens for o in outs)
    if decode_steps is not None:
        assert decode_steps  # some steps ran as a graph replays them
    for rid, (prompt, out) in zip(sorted(checker.store.rows, key=int), zip(PROMPTS, outs)):
        rows = checker.store.rows[rid]
        tokens = prompt + out.token_ids
        assert sorted(rows) == list(range(len(rows))) and len(rows) >= len(tokens) - 1 - BLOCK
        want, _ = transformers_layers[arch](tokens)
        got = torch.stack([rows[p] for p in range(len(rows))])
        torch.testing.assert_close(got, want[:len(rows)], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch", ARCHS)
def test_training_captures_the_same_rows(arch, transformers_layers):
    """Drafter training's feature capture (training/features.py) through the same tap: the features of every
    position equal transformers' layer outputs, and the final hidden states (the last layer's row, normed) its
    final norm's output."""
    from onecat.training.features import capture_features

    seqs = [(list(range(10, 40)), 10, False), ([5, 6, 7, 8] * 5, 4, True)]
    with LLM(str(DATA / arch), dtype="float32", max_model_len=64, enable_prefix_caching=False,
             max_num_batched_tokens=16) as llm:
        feats, _ = capture_features(llm, seqs, TAPS, torch.float32, log=lambda line: None)
        assert llm.model.aux_layer_ids == []  # the tap is off again
    for (ids, _, _), start, n in zip(seqs, feats.starts, feats.lengths):
        want, final = transformers_layers[arch](ids)
        torch.testing.assert_close(feats.features[start:start + n], want, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(feats.final_hidden[start:start + n], final, rtol=1e-4, atol=1e-4)


# ---- outputs ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("k,memory", [(1, {}), (2, {"max_num_batched_tokens": 8}), (4, {}),
                                      (3, {"max_num_batched_tokens": 8, "block_size": 4, "num_kv_blocks": 20,
                                           "max_num_seqs": 3, "max_model_len": 64})])
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_dflash_is_token_identical(arch, k, memory, drafters, reference_tokens):
    """The drafter's own drafts, batched and cached (checked against recomputing each request alone), at k = 1..4;
    with chunked prefills, and with preemption (recomputed from position 0, the drafter's rows replaced)."""
    with LLM(str(DATA / arch), dtype="float32", **({"max_model_len": 128} | memory),
             speculative_config=dflash(drafters, arch, k)) as llm:
        checker = DraftChecker(llm.engine.proposer.proposer)
        outs = llm.generate(PROMPTS, greedy())
        assert checker.rounds > 0 and all(o.spec.num_drafts > 0 for o in outs)
        assert (llm.engine.scheduler.num_preemptions > 0) == ("num_kv_blocks" in memory)
        assert llm.engine.proposer.proposer.cache.entries == {}
    assert [o.token_ids for o in outs] == reference_tokens[arch]


# the MoE target marked slow: rejection sampling and the state rollback it drives are the same code for both
# targets, and the dense one keeps the law checked by default; the MoE target's verify rows stay checked by default
# in test_greedy_dflash_is_token_identical (its tokens equal target-only's at k = 1..4)
@pytest.mark.parametrize("arch", [ARCHS[0], pytest.param(ARCHS[1], marks=pytest.mark.slow)])
def test_seeded_sampling_keeps_the_target_law(arch, drafters):
    """Top-k sampling at temperature 1: the joint law of the first two tokens (the second one verified) is the
    target's, by chi-square; the random drafter's q is far from p, so rejection sampling does real work."""
    k, n = 3, 3000
    prompt = [5, 9, 17, 3, 44, 2]
    with LLM(str(DATA / arch), dtype="float32", max_model_len=64) as plain:
        first, second, law = top_k_two_token_law(plain, prompt, k)
    with LLM(str(DATA / arch), dtype="float32", max_model_len=64, max_num_seqs=256,
             speculative_config=dflash(drafters, arch, 2)) as llm:
        params = [SamplingParams(temperature=1.0, top_k=k, seed=s, max_tokens=3, ignore_eos=True) for s in range(n)]
        outs = llm.generate([prompt] * n, params)
        again = llm.generate([prompt] * 8, params[:8])
    assert [o.token_ids for o in again] == [o.token_ids for o in outs[:8]]  # seeded: the same draws
    assert sum(o.spec.num_drafts for o in outs) >= n * 0.9
    assert sum(o.spec.num_accepted_tokens for o in outs) < sum(o.spec.num_draft_tokens for o in outs)  # rejections
    counts = torch.zeros(k, k, dtype=torch.float64)
    for o in outs:
        t1, t2 = o.token_ids[:2]
        counts[first.index(t1), second[t1].index(t2)] += 1  # top-k sampling never leaves these cells
    expected = law.double().flatten() * n
    assert (expected >= 5).all()
    assert chisquare(counts.flatten().numpy(), (expected * n / expected.sum()).numpy()).pvalue > ALPHA


@pytest.mark.parametrize("arch", ARCHS)
def test_align_prefix_hits_give_the_tokens_of_no_cache(arch, drafters):
    """mamba_cache_mode align with 4-token blocks: verify chunks end at block boundaries, states are saved there;
    a second request sharing the first's prompt and output hits those blocks (state restored) and its drafter
    context starts at the hit. Tokens equal target-only without any cache."""
    shared = list(range(20, 52))
    prompts = [shared + [7, 8, 9], shared + [99, 98]]
    with LLM(str(DATA / arch), dtype="float32", max_model_len=128, block_size=4) as base:  # no cache for hybrids
        first_ref = base.generate(prompts[:1], greedy(16))[0].token_ids
        second = [prompts[0] + first_ref + [3], prompts[1]]
        second_ref = [o.token_ids for o in base.generate(second, greedy(16))]
    with LLM(str(DATA / arch), dtype="float32", max_model_len=128, block_size=4, mamba_cache_mode="align",
             speculative_config=dflash(drafters, arch, 4)) as llm:
        proposer = llm.engine.proposer.proposer
        checker = DraftChecker(proposer)
        steer_drafts(proposer, prompts[:1] + second, [first_ref] + second_ref)
        first = llm.generate(prompts[:1], greedy(16))[0]
        again = llm.generate(second, greedy(16))
        states = llm.model.states
        assert states.saved > 0 and states.restored == 2 and states.rollbacks > 0
    assert first.token_ids == first_ref and [o.token_ids for o in again] == second_ref
    hits = [o.num_cached_tokens for o in again]
    assert hits[0] > len(prompts[0]) and hits[0] % 4 == 0 and hits[1] == 32  # into generated blocks; the shared prompt
    assert all(o.spec.num_accepted_tokens > 0 for o in [first] + again)
    for rid, hit in zip(sorted(checker.store.rows, key=int)[1:], hits):  # the drafter saw no cached position
        assert min(checker.store.rows[rid]) == hit


# ---- a drafter for a hybrid target ------------------------------------------------------------------------------
def test_drafter_config_for_a_hybrid_target():
    """The drafter copies the target's attention shape (the gated-attention layers' heads); a MoE target has no
    dense MLP width to copy, so the drafter's must be given."""
    from onecat.training.drafter import drafter_config

    dense, moe = target_config("tiny-qwen35"), target_config("tiny-qwen35moe")
    cfg = drafter_config(dense, block_size=8, layer_ids=[1, 2], num_layers=1, intermediate_size=None, mask_token_id=0)
    assert (cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"],
            cfg["intermediate_size"], cfg["rope_theta"]) == (32, 2, 1, 16, 48, 10000.0)
    with pytest.raises(ConfigError, match="intermediate_size"):
        drafter_config(moe, block_size=8, layer_ids=[1, 2], num_layers=1, intermediate_size=None, mask_token_id=0)
    assert drafter_config(moe, block_size=8, layer_ids=[1, 2], num_layers=1, intermediate_size=40,
                          mask_token_id=0)["intermediate_size"] == 40


# ---- CUDA graphs ------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_graph_decode_steps_hand_the_drafter_the_eager_rows(tmp_path):
    """On a GPU in bfloat16 (test_hybrid_gpu.py's graph-safe hybrid), cuda_graph full: decode steps replay graphs
    that keep the tapped rows as an output (verify steps stay eager). Each position's row the drafter gets equals
    the eager engine's, up to where the two runs' tokens part (bf16 rounding)."""
    from tests.test_hybrid_gpu import GRAPH_MODEL, GRAPH_PROMPTS
    from tests.tiny_moe_hybrid import make_tiny_moe_hybrid

    target = make_tiny_moe_hybrid("qwen3_5", tmp_path / "target", **GRAPH_MODEL)
    drafter = make_drafter(target_config(target), tmp_path / "dflash", seed=0)
    settings = dict(dtype="bfloat16", device="cuda", max_num_seqs=4, enable_prefix_caching=False)
    with LLM(str(target), **settings) as plain:
        reference = [o.token_ids for o in plain.generate(GRAPH_PROMPTS, greedy(16))]
    runs = {}
    for mode in ("off", "full"):
        with LLM(str(target), cuda_graph=mode, speculative_config=dflash({"target": drafter}, "target", 3),
                 **settings) as llm:
            proposer = llm.engine.proposer.proposer
            rows: dict[str, dict[int, torch.Tensor]] = {}
            record = proposer.record_features

            def keep(seq, span, rows=rows, record=record):  # every row by position (bf16 drafts not compared)
                first = seq.num_computed_tokens - span.count
                rows.setdefault(seq.request_id, {}).update(
                    {first + i: f.float().cpu() for i, f in enumerate(span.rows())})
                record(seq, span)

            proposer.record_features = keep
            steer_drafts(proposer, GRAPH_PROMPTS, reference)
            outs = llm.generate(GRAPH_PROMPTS, greedy(16))
            runs[mode] = ([p + o.token_ids for p, o in zip(GRAPH_PROMPTS, outs)], rows, llm.cuda_graph_report())
    (eager_tokens, eager_rows, _), (graph_tokens, graph_rows, report) = runs["off"], runs["full"]
    assert report["replays"] > 0 and report["disabled_reason"] is None, report
    compared = 0
    for a, b, rid_a, rid_b in zip(eager_tokens, graph_tokens, sorted(eager_rows, key=int), sorted(graph_rows, key=int)):
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        for p in sorted(set(eager_rows[rid_a]) & set(graph_rows[rid_b])):
            if p < same:
                torch.testing.assert_close(graph_rows[rid_b][p], eager_rows[rid_a][p], rtol=3e-2, atol=3e-2)
                compared += 1
    assert compared > 0
