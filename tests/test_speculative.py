"""Speculative decoding is exact: greedy outputs equal target-only; sampled outputs follow the target law."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file
from scipy.stats import chisquare

from onecat.engine import LLM, SamplingParams
from onecat.engine.errors import ConfigError, ModelNotFoundError
from onecat.engine.model_source import DRAFTERS_DIR, EMBEDDED_DRAFTERS, resolve_model_source
from tests.conftest import EMBEDDED
from tests.tiny_models import make_tiny_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
PROMPTS = [
    "def area(w, h):\n    return w * h\n\ndef perimeter(w, h):\n    return 2 * (w + h)\n\n# again:\ndef area(w, h):\n",
    "red green blue red green blue red green",
    "Once upon a time",
    "x = [1, 2, 3]\ny = [1, 2, 3]\nz = [1,",
]


def write_random_dflash(path, hidden: int, vocab_mask: int, target_layers: list[int], block_size: int = 5,
                        sliding_window: int | None = None):
    cfg = {"architectures": ["DFlashDraftModel"], "hidden_size": hidden, "intermediate_size": 128,
           "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
           "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
           "dflash_config": {"block_size": block_size, "target_layer_ids": target_layers, "mask_token_id": vocab_mask}}
    if sliding_window is not None:
        cfg |= {"use_sliding_window": True, "sliding_window": sliding_window}
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    g = torch.Generator().manual_seed(0)
    L = len(target_layers)

    def r(*shape):
        return (torch.randn(*shape, generator=g) * 0.05).contiguous()

    w = {"fc.weight": r(hidden, L * hidden), "hidden_norm.weight": torch.ones(hidden), "norm.weight": torch.ones(hidden)}
    p = "layers.0."
    w |= {p + "self_attn.q_proj.weight": r(128, hidden), p + "self_attn.k_proj.weight": r(64, hidden),
          p + "self_attn.v_proj.weight": r(64, hidden), p + "self_attn.o_proj.weight": r(hidden, 128),
          p + "self_attn.q_norm.weight": torch.ones(32), p + "self_attn.k_norm.weight": torch.ones(32),
          p + "input_layernorm.weight": torch.ones(hidden), p + "post_attention_layernorm.weight": torch.ones(hidden),
          p + "mlp.gate_proj.weight": r(128, hidden), p + "mlp.up_proj.weight": r(128, hidden), p + "mlp.down_proj.weight": r(hidden, 128)}
    save_file(w, str(path / "model.safetensors"))
    return path


@pytest.fixture(scope="module")
def target_tokens(embedded_llm):
    return [o.token_ids for o in embedded_llm.generate(PROMPTS, GREEDY)]


def spec_config(method, tmp_path_factory, embedded_path):
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": 4}
    if method == "ngram_adaptive":
        return {"method": "ngram", "num_speculative_tokens": 2, "adaptive": True, "max_speculative_tokens": 8}
    if method == "draft_model":
        return {"method": "draft_model", "num_speculative_tokens": 3, "model": str(embedded_path)}
    d = write_random_dflash(tmp_path_factory.mktemp("dflash"), 576, 0, [1, 14, 28])
    return {"method": "dflash", "num_speculative_tokens": 4, "model": str(d)}


def test_rejected_block_drafts_shrink_to_one_a_round_and_keep_the_tokens(target_tokens, tmp_path_factory,
                                                                          embedded_path):
    """A random block drafter (every draft rejected), drafting every round (gate off): after a few rounds each
    request drafts one token a round (engine/speculative/draft_length.py), and the tokens stay target-only's."""
    spec = {**spec_config("dflash", tmp_path_factory, embedded_path), "disable_when_slower": False}
    with LLM(EMBEDDED, max_model_len=512, speculative_config=spec) as llm:
        outs = llm.generate(PROMPTS, GREEDY)
        lengths = llm.info()["speculative"]["draft_lengths"]
    assert [o.token_ids for o in outs] == target_tokens
    assert lengths["drafts_asked_per_block"] < 0.5, lengths
    for o in outs:  # 39 rounds: the first few of all 4 drafts, the rest of 1
        assert o.spec.num_drafts >= 30 and o.spec.num_draft_tokens < 2 * o.spec.num_drafts


@pytest.mark.parametrize("method", ["ngram", pytest.param("ngram_adaptive", marks=pytest.mark.slow),
                                    pytest.param("draft_model", marks=pytest.mark.slow), "dflash"])
def test_greedy_speculation_is_token_identical(method, target_tokens, tmp_path_factory, embedded_path):
    with LLM(EMBEDDED, max_model_len=512,
             speculative_config=spec_config(method, tmp_path_factory, embedded_path)) as llm:
        _check_greedy_speculation(llm, method, target_tokens)


def _check_greedy_speculation(llm, method, target_tokens):
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == target_tokens
    drafts = sum(o.spec.num_drafts for o in outs)
    accepted = sum(o.spec.num_accepted_tokens for o in outs)
    assert drafts > 0
    if method == "draft_model":  # the target drafting for itself: every draft token is accepted
        assert accepted == sum(o.spec.num_draft_tokens for o in outs)
    if method.startswith("ngram"):
        assert accepted > 0
    for o in outs:
        assert sum(o.spec.accepted_per_position) == o.spec.num_accepted_tokens
    if method == "dflash":  # a block drafter's requests draft as far as their rounds say is worth it
        assert llm.info()["speculative"]["draft_lengths"]["drafts_asked_per_block"] <= 1.0
    # again: now with prefix-cache hits on every prompt
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == target_tokens


def test_verified_tokens_carry_their_logprobs(embedded_llm, embedded_path):
    """Requested logprobs come for every token, verified ones too (row j of the verify logits), with
    the values target-only decoding gives (CPU float32 matmuls are batch-invariant)."""
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)
    base = embedded_llm.generate(PROMPTS[:2], params)
    spec = {"method": "draft_model", "num_speculative_tokens": 3, "model": str(embedded_path)}
    with LLM(EMBEDDED, max_model_len=512, speculative_config=spec) as llm:
        fast = llm.generate(PROMPTS[:2], params)
    for b, f in zip(base, fast):
        assert f.spec.num_accepted_tokens > 0 and f.token_ids == b.token_ids
        assert len(f.logprobs) == len(f.token_ids)
        for tok, fd, bd in zip(f.token_ids, f.logprobs, b.logprobs):
            assert tok in fd and len(fd) >= 2 and fd.keys() == bd.keys()
            assert fd == pytest.approx(bd, abs=1e-5)


def test_speculation_with_preemption_and_mixed_batch(target_tokens):
    params = [GREEDY, GREEDY, GREEDY, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True,
                                                     prompt_logprobs=0)]
    with LLM(EMBEDDED, max_model_len=96, max_num_batched_tokens=16, block_size=4, num_kv_blocks=40,
             speculative_config={"method": "ngram", "num_speculative_tokens": 4}) as llm:
        outs = llm.generate(PROMPTS, params)
        assert llm.engine.scheduler.num_preemptions > 0
        assert [o.token_ids for o in outs] == target_tokens
        assert llm.engine.blocks.num_free_blocks == 39


def test_bad_speculative_config():
    with pytest.raises(ConfigError, match="not supported"):
        LLM(EMBEDDED, max_model_len=64, speculative_config={"method": "eagle9", "num_speculative_tokens": 2})
    with pytest.raises(ConfigError, match="positive integer"):
        LLM(EMBEDDED, max_model_len=64, speculative_config={"method": "ngram", "num_speculative_tokens": 0})


# ---- sampled decoding keeps the target distribution ------------------------------------------------
N_SAMPLES = 6000
ALPHA = 1e-3  # each chi-square test raises a false alarm with probability 0.001 when speculation is exact


def exact_two_token_law(llm, prompt: list[int]) -> torch.Tensor:
    """P(t1, t2 | prompt) = P(t1 | prompt) P(t2 | prompt, t1), from target-only scoring; [V, V]."""
    V = llm.model_config.vocab_size
    p1 = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, logprobs=V))[0].logprobs[0]
    p1 = torch.tensor([p1[t] for t in range(V)]).exp()
    rows = llm.generate([prompt + [t] for t in range(V)], SamplingParams(temperature=0, max_tokens=1, logprobs=V))
    p2 = torch.stack([torch.tensor([r.logprobs[0][t] for t in range(V)]).exp() for r in rows])
    return p1.unsqueeze(1) * p2


@pytest.mark.parametrize("method", ["ngram", "draft_model", "dflash"])
def test_sampled_speculation_matches_target_distribution(tmp_path, method):
    target_dir = make_tiny_model("llama", tmp_path / "target", vocab_size=12, num_hidden_layers=2)
    if method == "ngram":
        spec = {"method": "ngram", "num_speculative_tokens": 3}
    elif method == "draft_model":
        draft_dir = make_tiny_model("llama", tmp_path / "draft", vocab_size=12, num_hidden_layers=1)
        spec = {"method": "draft_model", "num_speculative_tokens": 2, "model": str(draft_dir)}
    else:  # a random drafter on the tiny target: its q is far from p, so rejection sampling does real work
        draft_dir = write_random_dflash(tmp_path / "dflash", 64, 0, [0, 1], block_size=4)
        spec = {"method": "dflash", "num_speculative_tokens": 2, "model": str(draft_dir)}
    # every token occurs in the prompt, so after any first token t1 the n-gram proposer finds a draft
    prompt = list(range(12)) + [0, 1, 2]
    plain = LLM(str(target_dir), max_model_len=64, max_num_seqs=256)
    law = exact_two_token_law(plain, prompt).flatten()
    llm = LLM(str(target_dir), max_model_len=64, max_num_seqs=256, speculative_config=spec)
    # token 1 is sampled after prefill; token 2 is the first one that goes through verification
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=3, ignore_eos=True) for s in range(N_SAMPLES)]
    outs = llm.generate([prompt] * N_SAMPLES, params)
    assert sum(o.spec.num_drafts for o in outs) >= N_SAMPLES * 0.9  # speculation really ran
    assert any(o.spec.num_accepted_tokens < o.spec.num_draft_tokens for o in outs)  # and rejected sometimes
    pairs = torch.tensor([o.token_ids[0] * 12 + o.token_ids[1] for o in outs])  # joint of (t1, t2)
    counts = torch.bincount(pairs, minlength=144).double()
    expected = law.double() * N_SAMPLES
    keep = expected >= 5  # pool rare cells so the chi-square approximation holds
    obs = torch.cat([counts[keep], counts[~keep].sum().view(1)]) if (~keep).any() else counts
    exp = torch.cat([expected[keep], expected[~keep].sum().view(1)]) if (~keep).any() else expected
    exp = exp * obs.sum() / exp.sum()
    assert chisquare(obs.numpy(), exp.numpy()).pvalue > ALPHA


# ---- the committed drafter of the embedded model ---------------------------------------------------
TRAINED_DFLASH = DRAFTERS_DIR / EMBEDDED_DRAFTERS["smollm2-135m-dflash"]
needs_trained_dflash = pytest.mark.skipif(
    not (TRAINED_DFLASH / "model.safetensors").is_file(),
    reason=f"the trained drafter embedded:smollm2-135m-dflash is not committed yet ({TRAINED_DFLASH} has no "
           "model.safetensors)")
TRAINED_SPEC = {"method": "dflash", "model": "embedded:smollm2-135m-dflash", "num_speculative_tokens": 15}
CHAT_QUESTIONS = ["What is the tallest mountain in Europe?", "Give me three tips for learning a new language.",
                  "Explain what a binary search does.", "Write a haiku about autumn."]


def test_embedded_drafter_is_refused_clearly_until_committed():
    if (TRAINED_DFLASH / "model.safetensors").is_file():
        assert resolve_model_source("embedded:smollm2-135m-dflash").path == TRAINED_DFLASH
    else:
        with pytest.raises(ModelNotFoundError, match="not present in this install"):
            resolve_model_source("embedded:smollm2-135m-dflash")


@needs_trained_dflash
def test_trained_dflash_is_token_identical_and_accepts(embedded_llm):
    prompts = [[{"role": "user", "content": q}] for q in CHAT_QUESTIONS]
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    want = [o.token_ids for o in embedded_llm.chat(prompts, params)]
    with LLM(EMBEDDED, max_model_len=512, speculative_config=TRAINED_SPEC) as llm:
        outs = llm.chat(prompts, params)
    assert [o.token_ids for o in outs] == want
    drafts = sum(o.spec.num_drafts for o in outs)
    acceptance_length = 1 + sum(o.spec.num_accepted_tokens for o in outs) / drafts
    # a random drafter gives 1.00; the committed drafter (3,855 steps) measures 1.63 here (64 tokens past EOS)
    assert acceptance_length > 1.45, f"acceptance length {acceptance_length:.2f} of the trained drafter"


def top_k_two_token_law(llm, prompt: list[int], k: int) -> tuple[list[int], dict[int, list[int]], torch.Tensor]:
    """Under top-k sampling at temperature 1: the k first tokens, the k second tokens after each, and
    P(t1, t2 | prompt) [k, k], from target-only top-k logprobs (top-k keeps p proportional to exp(logit))."""
    def top(ids):
        lp = llm.generate([ids], SamplingParams(temperature=0, max_tokens=1, logprobs=k))[0].logprobs[0]
        best = sorted(lp, key=lp.get, reverse=True)[:k]
        return best, torch.tensor([lp[t] for t in best]).softmax(dim=0)

    first, p1 = top(prompt)
    second, p2 = {}, []
    for t in first:
        second[t], p = top(prompt + [t])
        p2.append(p)
    return first, second, p1.unsqueeze(1) * torch.stack(p2)


@pytest.mark.slow
@needs_trained_dflash
def test_trained_dflash_sampling_matches_target_distribution(embedded_llm):
    k, n = 4, 1500
    tok = embedded_llm.tokenizer
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": CHAT_QUESTIONS[0]}]),
                        add_special_tokens=False)
    first, second, law = top_k_two_token_law(embedded_llm, prompt, k)
    with LLM(EMBEDDED, max_model_len=256, max_num_seqs=256, speculative_config=TRAINED_SPEC) as llm:
        params = [SamplingParams(temperature=1.0, top_k=k, seed=s, max_tokens=3, ignore_eos=True) for s in range(n)]
        outs = llm.generate([prompt] * n, params)
    assert sum(o.spec.num_drafts for o in outs) >= n * 0.9
    counts = torch.zeros(k, k, dtype=torch.float64)
    for o in outs:
        t1, t2 = o.token_ids[:2]
        counts[first.index(t1), second[t1].index(t2)] += 1  # top-k sampling never leaves these cells
    expected = law.double().flatten() * n
    keep = expected >= 5
    obs = torch.cat([counts.flatten()[keep], counts.flatten()[~keep].sum().view(1)])
    exp = torch.cat([expected[keep], expected[~keep].sum().view(1)])
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    assert chisquare(obs.numpy(), (exp * obs.sum() / exp.sum()).numpy()).pvalue > ALPHA


def test_dflash_drafter_of_another_target_is_refused(tmp_path):
    target_dir = make_tiny_model("llama", tmp_path / "target", vocab_size=12, num_hidden_layers=2)
    for name, hidden, layers, match in [("wide", 576, [0, 1], "belongs to another target"),
                                        ("deep", 64, [1, 5], r"target_layer_ids \[5\] are outside")]:
        drafter = write_random_dflash(tmp_path / name, hidden, 0, layers)
        with pytest.raises(ConfigError, match=match):
            LLM(str(target_dir), max_model_len=64,
                speculative_config={"method": "dflash", "num_speculative_tokens": 2, "model": str(drafter)})
