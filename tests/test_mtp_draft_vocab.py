"""Method mtp over a draft vocabulary (speculative_config draft_vocab_size, engine/speculative/mtp.py): each draft
step scores the head's output over the ids ranked in the checkpoint's directory instead of the whole LM head. On
the tiny Qwen3.5 checkpoint with a head that agrees with the target (tests/test_mtp.py): ids that hold the target's
tokens keep every draft accepted, ids that hold none of them get every draft rejected, and the tokens are the
target's either way."""
from __future__ import annotations

import json

import pytest

from onecat.engine import LLM
from onecat.engine.errors import ConfigError
from tests.test_mtp import DATA, GREEDY, MTP, PROMPTS, SETTINGS, edited_copy, make_head_agree_with_target

VOCAB = 128  # the tiny checkpoint's


@pytest.fixture(scope="module")
def agreeing(tmp_path_factory):
    path = edited_copy(DATA / "tiny-qwen35", tmp_path_factory.mktemp("mtp") / "agree", make_head_agree_with_target)
    with LLM(str(path), **SETTINGS) as llm:
        reference = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    return path, reference


def _run(path, ranked: list[int], size: int):
    (path / "draft_vocab.json").write_text(json.dumps({"ids": ranked, "tokens": 0}))
    with LLM(str(path), speculative_config={**MTP, "draft_vocab_size": size}, **SETTINGS) as llm:
        outs = llm.generate(PROMPTS, GREEDY)
        return outs, llm.info()["speculative"]


def test_ids_holding_the_targets_tokens_keep_its_drafts_accepted(agreeing):
    path, reference = agreeing
    wanted = sorted({t for out in reference for t in out} | {t for p in PROMPTS for t in p})
    rest = [t for t in range(VOCAB) if t not in wanted]
    outs, info = _run(path, wanted + rest, len(wanted))
    assert [o.token_ids for o in outs] == reference
    drafted = sum(o.spec.num_draft_tokens for o in outs)
    assert drafted > 0 and sum(o.spec.num_accepted_tokens for o in outs) == drafted
    assert info["draft_vocab"]["size"] == len(wanted) and info["draft_vocab"]["of"] == VOCAB


def test_ids_holding_none_of_them_get_every_draft_rejected_and_keep_the_tokens(agreeing):
    path, reference = agreeing
    produced = {t for out in reference for t in out}
    others = [t for t in range(VOCAB) if t not in produced]
    outs, _ = _run(path, others + sorted(produced), len(others))
    assert [o.token_ids for o in outs] == reference
    assert sum(o.spec.num_draft_tokens for o in outs) > 0 and sum(o.spec.num_accepted_tokens for o in outs) == 0


def test_a_missing_ranking_is_refused_with_the_fix(tmp_path):
    path = edited_copy(DATA / "tiny-qwen35", tmp_path / "ckpt", make_head_agree_with_target)
    with pytest.raises(ConfigError, match="onecat drafter vocab"):
        LLM(str(path), speculative_config={**MTP, "draft_vocab_size": 16}, **SETTINGS)


def test_a_head_kept_only_in_onednns_blocked_layout_gives_its_rows_back_exactly():
    """A CPU float32 LM head whose dense copy pack_weight dropped (an untied head, as the tiny checkpoint's): the
    draft vocabulary reads its rows back from the blocked copy, bit for bit."""
    import torch

    from onecat.engine.layers import batch_invariant_linear as bil
    from onecat.engine.layers.linear import Linear

    if not torch.backends.mkldnn.is_available():
        pytest.skip("oneDNN is not available")
    head = Linear(48, 300, bias=False)
    want = head.weight.detach().clone()
    bil.pack_weight(head, keep_dense=False)
    assert head.weight.is_meta and torch.equal(bil.dense_weight(head), want)


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU")
def test_mtp_rounds_over_a_draft_vocabulary_replay_cuda_graphs(agreeing):
    """On a GPU with cuda_graph full the drafting loop, ranked head included, replays the head's graphs: with ids
    holding the target's tokens every draft of the agreeing head is accepted, and the tokens are target-only's."""
    path, _ = agreeing
    settings = dict(SETTINGS, device="cuda", dtype="float32", cuda_graph="full")
    with LLM(str(path), **settings) as llm:
        reference = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    wanted = sorted({t for out in reference for t in out} | {t for p in PROMPTS for t in p})
    (path / "draft_vocab.json").write_text(json.dumps({"ids": wanted + [t for t in range(VOCAB) if t not in wanted],
                                                       "tokens": 0}))
    with LLM(str(path), speculative_config={**MTP, "draft_vocab_size": len(wanted)}, **settings) as llm:
        outs = llm.generate(PROMPTS, GREEDY)
        described = llm.info()["speculative"]
    assert [o.token_ids for o in outs] == reference
    drafted = sum(o.spec.num_draft_tokens for o in outs)
    assert drafted > 0 and sum(o.spec.num_accepted_tokens for o in outs) == drafted
    assert described["cuda_graph_replays"] > 0 and described["draft_vocab"]["size"] == len(wanted), described
