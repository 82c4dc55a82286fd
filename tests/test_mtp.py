"""Speculative method mtp: the checkpoint's own multi-token-prediction head drafts, the exact verifier keeps the
target's outputs. On the tiny Qwen3.5 checkpoints of tests/data (hidden 32, vocab 128, 4 layers), copied with
the `mtp.*` tensors each test needs.

The head's computation is checked against a plain-torch reference written here from the checkpoint's tensors
(full causal attention over every position, each further draft one more row of the sequence), on a batch of
requests with contexts of different lengths."""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from scipy.stats import chisquare

from onecat.engine import LLM, SamplingParams
from onecat.engine.core.keyed_draws import row_keys
from onecat.engine.core.sampler import sample
from onecat.engine.errors import ConfigError

DATA = Path(__file__).parent / "data"
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
PROMPTS = [[5, 17, 99, 3, 5, 17, 99, 3, 5], list(range(10, 40)), [100], [7, 8, 9, 7, 8, 9, 7, 8]]
MTP = {"method": "mtp", "num_speculative_tokens": 3, "disable_when_slower": False}
SETTINGS = dict(max_model_len=128, max_num_seqs=4)


# ---- checkpoints ---------------------------------------------------------------------------------------
def edited_copy(src: Path, dst: Path, edit) -> Path:
    """A copy of checkpoint directory `src` whose tensors `edit(state)` changed in place."""
    shutil.copytree(src, dst)
    state = load_file(str(dst / "model.safetensors"))
    edit(state)
    save_file(state, str(dst / "model.safetensors"))
    return dst


def add_random_mtp(state: dict, seed: int = 0) -> None:
    """An MTP head shaped like the target's full-attention layer 1 (dense MLP or MoE), random weights."""
    g = torch.Generator().manual_seed(seed)
    hidden = state["model.norm.weight"].shape[0]
    for name in [n for n in state if n.startswith("mtp.")]:
        del state[name]
    for name, t in list(state.items()):
        if name.startswith("model.layers.1."):
            state["mtp.layers.0." + name.removeprefix("model.layers.1.")] = (
                torch.randn(t.shape, generator=g) * (0.1 if t.dim() == 1 else 0.3))
    state["mtp.fc.weight"] = torch.randn(hidden, 2 * hidden, generator=g) * 0.2
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        state[f"mtp.{norm}.weight"] = torch.randn(hidden, generator=g) * 0.1


def make_head_agree_with_target(state: dict) -> None:
    """Every token mixer and MLP of the target writes zeros, so it predicts from the current token alone
    (lm_head(norm(embed(t)))); the head passes the next token's normed embedding through (fc = [I 0], the
    layer writes zeros) into the target's final norm: its guess at t_{i+2} is the target's."""
    add_random_mtp(state)
    for name in state:
        if name.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight")):
            state[name].zero_()
    hidden = state["model.norm.weight"].shape[0]
    state["mtp.fc.weight"] = torch.cat([torch.eye(hidden), torch.zeros(hidden, hidden)], dim=1)
    state["mtp.pre_fc_norm_embedding.weight"] = torch.zeros(hidden)
    state["mtp.norm.weight"] = state["model.norm.weight"].clone()


@pytest.fixture(scope="module")
def dense() -> Path:
    return DATA / "tiny-qwen35"  # carries an MTP head as committed


@pytest.fixture(scope="module")
def moe(tmp_path_factory) -> Path:
    return edited_copy(DATA / "tiny-qwen35moe", tmp_path_factory.mktemp("moe") / "ckpt", add_random_mtp)


# ---- a plain-torch reference of the head ---------------------------------------------------------------
def zc_norm(x, weight, eps=1e-6):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight.float())).to(x.dtype)


def rope(x, positions, rotary_dim, theta=10000.0):
    """Half-split rotary embedding on the first rotary_dim dims of x [T, heads, d]."""
    inv = 1.0 / theta ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim)
    angles = positions.float()[:, None] * inv
    cos, sin = torch.cat([angles.cos()] * 2, -1)[:, None], torch.cat([angles.sin()] * 2, -1)[:, None]
    r, half = x[..., :rotary_dim], rotary_dim // 2
    rotated = r * cos + torch.cat([-r[..., half:], r[..., :half]], -1) * sin
    return torch.cat([rotated, x[..., rotary_dim:]], -1)


def swiglu(w, prefix, x):
    return (F.silu(x @ w[prefix + "gate_proj.weight"].T) * (x @ w[prefix + "up_proj.weight"].T)) @ w[
        prefix + "down_proj.weight"].T


def ref_mlp(w, cfg, x):
    p = "mtp.layers.0.mlp."
    if p + "gate.weight" not in w:
        return swiglu(w, p, x)
    probs = torch.softmax(x @ w[p + "gate.weight"].T, -1)
    top, ids = probs.topk(cfg["num_experts_per_tok"], -1)
    top = top / top.sum(-1, keepdim=True)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for weight, e in zip(top[t], ids[t].tolist()):
            out[t] += weight * swiglu(w, f"{p}experts.{e}.", x[t:t + 1])[0]
    return out + torch.sigmoid(x @ w[p + "shared_expert_gate.weight"].T) * swiglu(w, p + "shared_expert.", x)


def ref_head(w, cfg, inputs):
    """The head's output y [N, H] for layer inputs x [N, H] at positions 0..N-1, causal attention."""
    p, N = "mtp.layers.0.", inputs.shape[0]
    nh, nkv, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    rd = int(d * cfg["rope_parameters"]["partial_rotary_factor"])
    pos = torch.arange(N)
    a = zc_norm(inputs, w[p + "input_layernorm.weight"])
    qg = (a @ w[p + "self_attn.q_proj.weight"].T).view(N, nh, 2 * d)
    q = rope(zc_norm(qg[..., :d], w[p + "self_attn.q_norm.weight"]), pos, rd)
    k = (a @ w[p + "self_attn.k_proj.weight"].T).view(N, nkv, d)
    k = rope(zc_norm(k, w[p + "self_attn.k_norm.weight"]), pos, rd)
    v = (a @ w[p + "self_attn.v_proj.weight"].T).view(N, nkv, d)
    k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * d ** -0.5
    scores = scores.masked_fill(torch.ones(N, N, dtype=torch.bool).triu(1), float("-inf"))
    o = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(N, nh * d)
    x = inputs + (o * torch.sigmoid(qg[..., d:].reshape(N, nh * d))) @ w[p + "self_attn.o_proj.weight"].T
    x = x + ref_mlp(w, cfg, zc_norm(x, w[p + "post_attention_layernorm.weight"]))
    return zc_norm(x, w["mtp.norm.weight"])


def ref_input(w, tokens, hidden):
    e = zc_norm(w["model.embed_tokens.weight"][tokens], w["mtp.pre_fc_norm_embedding.weight"])
    return torch.cat([e, zc_norm(hidden, w["mtp.pre_fc_norm_hidden.weight"])], -1) @ w["mtp.fc.weight"].T


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_head_matches_the_plain_torch_reference(kind, request):
    """Two requests (9 and 5 kept positions) draft 3 tokens together, sampled at temperature 1: each step's draft
    is the keyed draw from the reference's logits, whose input sequence grows by the drafted token and the head's
    own output."""
    path = request.getfixturevalue(kind)
    w, cfg = load_file(str(path / "model.safetensors")), json.loads((path / "config.json").read_text())
    with torch.no_grad(), LLM(str(path), speculative_config=MTP, dtype="float32", **SETTINGS) as llm:
        proposer = llm.engine.proposer.proposer
        g = torch.Generator().manual_seed(3)
        lengths, hidden, tokens = [9, 5], {}, {}
        for r, n in enumerate(lengths):  # target hidden states (after its final norm) and the tokens after them
            hidden[r], tokens[r] = torch.randn(n, 32, generator=g), torch.randint(0, 128, (n + 1,), generator=g)
            device = proposer.cache.device  # the engine's own device (a GPU where there is one)
            features = torch.cat([proposer.embed(tokens[r][1:].to(device)), hidden[r].to(device)], -1)
            proposer.cache.add(str(r), 0, features)
            proposer.newest[str(r)] = (n - 1, features[-1])
        proposer.cache.flush()
        params = SamplingParams(temperature=1.0, seed=0)
        # a request with n kept positions holds n + 1 tokens; its drafts are the tokens at n + 1, n + 2, ...
        seqs = [SimpleNamespace(request_id=str(r), params=params, seed=40 + r, num_tokens=n + 1)
                for r, n in enumerate(lengths)]
        drafts = proposer._draft(seqs, 3)
        for r, n in enumerate(lengths):
            x = ref_input(w, tokens[r][1:], hidden[r])
            for j in range(3):
                y = ref_head(w, cfg, x)[-1]
                key = row_keys([40 + r], [n + 1 + j], "cpu")  # drawn as the target draws that position
                assert drafts[r][j] == sample((y @ w["lm_head.weight"].T)[None], [params], key)[0]
                x = torch.cat([x, ref_input(w, torch.tensor([drafts[r][j]]), y[None])])
        greedy = SimpleNamespace(request_id="1", params=SamplingParams(temperature=0.0), seed=0,
                                 num_tokens=lengths[1] + 1)
        drafts = proposer._draft([greedy], 3)
        x = ref_input(w, tokens[1][1:], hidden[1])
        for j in range(3):
            y = ref_head(w, cfg, x)[-1]
            assert drafts[0][j] == int((y @ w["lm_head.weight"].T).argmax())
            x = torch.cat([x, ref_input(w, torch.tensor([drafts[0][j]]), y[None])])


# ---- the engine with method mtp --------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_greedy_mtp_is_token_identical_and_releases_its_state(kind, request):
    path = str(request.getfixturevalue(kind))
    with LLM(path, **SETTINGS) as llm:
        reference = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    with LLM(path, speculative_config=MTP, **SETTINGS) as llm:
        outs = llm.generate(PROMPTS, GREEDY)
        assert [o.token_ids for o in outs] == reference
        assert all(o.spec.num_drafts > 0 for o in outs)
        proposer = llm.engine.proposer.proposer
        assert not proposer.newest and not proposer.cache.entries and not proposer.cache.pending  # released
        assert not proposer.pending and proposer.pending_rows == 0
        described = llm.info()["speculative"]
        assert described["method"] == "mtp" and described["num_speculative_tokens"] == 3
        assert described["hidden_state_of_layer"] == 3


def test_queued_features_flushed_early_give_the_same_drafts(tmp_path, monkeypatch):
    """The head's inputs are queued per step and formed at once before drafting, or earlier once FLUSH_ROWS rows
    wait (here 3: prefills flush mid-prompt, decode steps every few requests): the same drafts either way, so the
    same acceptance, and target-only's tokens."""
    from onecat.engine.speculative import mtp

    path = str(edited_copy(DATA / "tiny-qwen35", tmp_path / "agree", make_head_agree_with_target))  # drafts accepted
    default = mtp.FLUSH_ROWS
    with LLM(path, **SETTINGS) as llm:
        reference = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    runs = {}
    for rows in (default, 3):
        monkeypatch.setattr(mtp, "FLUSH_ROWS", rows)
        with LLM(path, speculative_config=MTP, **SETTINGS) as llm:
            outs = llm.generate(PROMPTS, GREEDY)
        runs[rows] = [(o.spec.num_drafts, o.spec.num_accepted_tokens) for o in outs]
        assert [o.token_ids for o in outs] == reference
    assert runs[3] == runs[default] and sum(n for _, n in runs[3]) > 0


def test_greedy_mtp_over_prefix_cache_hits(tmp_path):
    """mamba_cache_mode align keeps prefix caching on: a prompt again (and one sharing its first 64 tokens)
    computes only its uncached tail, so the head's kept positions start there; the tokens stay the target's
    and drafts are still accepted."""
    path = str(edited_copy(DATA / "tiny-qwen35", tmp_path / "agree", make_head_agree_with_target))
    shared = list(range(20, 84))
    prompts = [shared + [7, 8, 9, 10, 11, 12], shared + [99, 98]]
    with LLM(path, **SETTINGS) as llm:
        reference = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    with LLM(path, mamba_cache_mode="align", speculative_config=MTP, **SETTINGS) as llm:
        first = llm.generate(prompts[:1], GREEDY)
        again = llm.generate(prompts, GREEDY)
    assert first[0].num_cached_tokens == 0 and [o.num_cached_tokens for o in again] == [64, 64]
    assert [o.token_ids for o in first + again] == reference[:1] + reference
    assert all(o.spec.num_accepted_tokens > 0 for o in first + again)


def test_a_head_that_agrees_with_the_target_is_accepted(tmp_path):
    path = edited_copy(DATA / "tiny-qwen35", tmp_path / "agree", make_head_agree_with_target)
    with LLM(str(path), **SETTINGS) as llm:
        reference = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    with LLM(str(path), speculative_config=MTP, **SETTINGS) as llm:
        outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == reference
    drafted = sum(o.spec.num_draft_tokens for o in outs)
    assert drafted > 0 and sum(o.spec.num_accepted_tokens for o in outs) == drafted
    assert all(o.spec.accepted_per_position[0] == o.spec.num_drafts for o in outs)


def test_mtp_with_chunked_prefill_and_preemption(tmp_path):
    """Small chunks and a KV cache that forces preemption: the head's kept positions are recorded chunk by
    chunk and replaced when a preempted request recomputes them; the tokens stay the target's."""
    path = edited_copy(DATA / "tiny-qwen35", tmp_path / "agree", make_head_agree_with_target)
    small = dict(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=8, block_size=4, num_kv_blocks=18)
    with LLM(str(path), **small) as llm:
        reference = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    with LLM(str(path), speculative_config=MTP, **small) as llm:
        outs = llm.generate(PROMPTS, GREEDY)
        assert llm.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == reference
    assert sum(o.spec.num_accepted_tokens for o in outs) > 0


# ---- sampled decoding keeps the target distribution ------------------------------------------------------
N_SAMPLES = 4000
ALPHA = 1e-3
VOCAB = 12


def small_vocab(state: dict) -> None:
    """The first VOCAB rows of the embedding and LM head (a 12-token model, so the joint law of two tokens has
    144 cells), with a random MTP head."""
    add_random_mtp(state, seed=1)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        state[name] = state[name][:VOCAB].clone() * 4.0  # sharper, so q and p differ visibly


def test_sampled_mtp_matches_the_target_distribution(tmp_path):
    from tests.test_speculative import exact_two_token_law

    path = edited_copy(DATA / "tiny-qwen35", tmp_path / "v12", small_vocab)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "vocab_size": VOCAB}))
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    settings = dict(max_model_len=32, max_num_seqs=256)
    target_only = LLM(str(path), **settings)
    law = exact_two_token_law(target_only, prompt).flatten()
    llm = LLM(str(path), speculative_config={**MTP, "num_speculative_tokens": 2}, **settings)
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=3, ignore_eos=True) for s in range(N_SAMPLES)]
    outs = llm.generate([prompt] * N_SAMPLES, params)
    # drafter-invariant: each seeded request's tokens are target-only's (keyed draws)
    assert [o.token_ids for o in outs] == [o.token_ids for o in target_only.generate([prompt] * N_SAMPLES, params)]
    assert sum(o.spec.num_drafts for o in outs) >= N_SAMPLES * 0.9  # speculation really ran
    assert any(o.spec.num_accepted_tokens < o.spec.num_draft_tokens for o in outs)  # and rejected sometimes
    assert any(o.spec.num_accepted_tokens > 0 for o in outs)  # and accepted sometimes
    pairs = torch.tensor([o.token_ids[0] * VOCAB + o.token_ids[1] for o in outs])
    counts = torch.bincount(pairs, minlength=VOCAB * VOCAB).double()
    expected = law.double() * N_SAMPLES
    keep = expected >= 5  # pool rare cells so the chi-square approximation holds
    obs = torch.cat([counts[keep], counts[~keep].sum().view(1)]) if (~keep).any() else counts
    exp = torch.cat([expected[keep], expected[~keep].sum().view(1)]) if (~keep).any() else expected
    assert chisquare(obs.numpy(), (exp * obs.sum() / exp.sum()).numpy()).pvalue > ALPHA


# ---- refusals --------------------------------------------------------------------------------------------
def test_a_checkpoint_without_an_mtp_head_is_refused_clearly(tmp_path):
    with pytest.raises(ConfigError, match=r"carries no multi-token-prediction head .*mtp\.fc\.weight.*ngram or "
                                          r"draft_model"):
        LLM(str(DATA / "tiny-qwen35moe"), speculative_config=MTP, **SETTINGS)
    partial = edited_copy(DATA / "tiny-qwen35", tmp_path / "partial",
                          lambda s: [s.pop(n) for n in ("mtp.norm.weight", "mtp.layers.0.self_attn.o_proj.weight")])
    with pytest.raises(ConfigError, match=r"incomplete multi-token-prediction head: no tensor for "
                                          r"mtp\.layers\.0\.self_attn\.o_proj\.weight, mtp\.norm\.weight"):
        LLM(str(partial), speculative_config=MTP, **SETTINGS)
    with pytest.raises(ConfigError, match="gguf file, whose reader does not keep the MTP head"):
        LLM(str(DATA / "tiny-qwen35.gguf"), speculative_config=MTP, **SETTINGS)


def test_mtp_settings_that_would_be_ignored_are_refused():
    for extra, named in (({"model": "x"}, "model"), ({"dtype": "float16"}, "dtype")):
        with pytest.raises(ConfigError, match=f"has no drafter model: remove {named}"):
            LLM(str(DATA / "tiny-qwen35"), speculative_config={**MTP, **extra}, **SETTINGS)


def test_load_format_dummy_gives_a_random_head():
    """Random weights as the target's (loader/dummy.py: matrices N(0, 0.02^2), vectors one), drafting."""
    with LLM(str(DATA / "tiny-qwen35"), load_format="dummy", speculative_config=MTP, **SETTINGS) as llm:
        out = llm.generate([PROMPTS[0]], GREEDY)[0]
        head = llm.engine.proposer.proposer.head
        assert out.spec.num_drafts > 0
        assert 0.015 < float(head.fc.weight.std()) < 0.025 and bool((head.norm.weight == 1).all())


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_the_graph_buffers_of_a_greedy_round_give_the_eager_drafts(kind, request, monkeypatch):
    """The CUDA-graph path's static buffers (speculative/mtp_graphs.py, run eagerly here: capture needs a GPU): a
    round padded to a rows and a context bucket, over buffers still holding an earlier round's rows, drafts for
    each real request what the eager round drafts."""
    from onecat.engine.speculative.mtp_graphs import MTPGraphs

    with LLM(str(request.getfixturevalue(kind)), speculative_config=MTP, **SETTINGS) as llm:
        proposer = llm.engine.proposer.proposer
        width = 2 * llm.model_config.hidden_size
        graphs = MTPGraphs(proposer.head, proposer.embed, proposer.lm_head, proposer.cache, width, torch.device("cpu"))
        eager = proposer._draft
        compared = []

        def checked(seqs, steps):
            tokens = eager(seqs, steps)
            request_ids, last_positions = [s.request_id for s in seqs], [s.num_tokens - 2 for s in seqs]
            newest = torch.stack([proposer.newest[r][1] for r in request_ids])
            rows, ctx = graphs.bucket(len(request_ids), max(proposer.cache.lengths(request_ids)))
            for _ in range(2):
                graphs.load(request_ids, newest, last_positions, rows)
                got = graphs.forward(rows, ctx, steps)
                assert got[:len(request_ids)].tolist() == tokens
                assert graphs.lens[len(request_ids):rows].tolist() == [1] * (rows - len(request_ids))
            compared.append((len(request_ids), rows))
            return tokens

        monkeypatch.setattr(proposer, "_draft", checked)
        llm.generate(PROMPTS[:3], GREEDY)  # three requests: rounds of 3 fill a bucket of 4 with a padding row
    assert max(n for n, _ in compared) > 1 and any(rows > n for n, rows in compared)


@pytest.mark.gpu
def test_greedy_mtp_rounds_replay_cuda_graphs_and_keep_the_target_tokens(dense):
    """On a GPU with cuda_graph full, greedy rounds replay the head's graphs (mtp_graphs.py) and the output is
    target-only's."""
    settings = dict(SETTINGS, device="cuda", dtype="float32", cuda_graph="full")
    with LLM(str(dense), **settings) as llm:
        reference = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    with LLM(str(dense), speculative_config=MTP, **settings) as llm:
        outs = llm.generate(PROMPTS, GREEDY)
        described = llm.info()["speculative"]
    assert [o.token_ids for o in outs] == reference
    assert described["cuda_graphs"] and described["cuda_graph_replays"] > 0, described
    assert "cuda_graphs_off_reason" not in described


@pytest.mark.gpu
def test_sampled_mtp_rounds_replay_cuda_graphs_and_keep_the_target_tokens(dense):
    """Seeded sampled requests (top-k + top-p, top-p alone) beside a greedy one: their rounds replay the head's
    graphs with keyed draws inside (mtp_graphs.py), and every token is target-only's."""
    settings = dict(SETTINGS, device="cuda", dtype="float32", cuda_graph="full")
    params = [SamplingParams(temperature=0.9, top_k=20, top_p=0.9, seed=3, max_tokens=24, ignore_eos=True),
              SamplingParams(temperature=1.0, top_p=0.8, seed=4, max_tokens=24, ignore_eos=True), GREEDY,
              SamplingParams(temperature=0.7, seed=5, max_tokens=24, ignore_eos=True)]
    with LLM(str(dense), **settings) as llm:
        reference = [o.token_ids for o in llm.generate(PROMPTS, params)]
    with LLM(str(dense), speculative_config=MTP, **settings) as llm:
        outs = [o.token_ids for o in llm.generate(PROMPTS, params)]
        again = [o.token_ids for o in llm.generate(PROMPTS, params)]  # the rounds' keys met again: captured
        report = llm.engine.proposer.proposer.graphs.report()
    assert outs == again == reference
    assert any(key[3] for key in report["captured"]) and report["replays"] > 0, report
