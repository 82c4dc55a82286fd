"""A DFlash drafter's draft vocabulary (engine/speculative/draft_vocab.py, speculative_config.draft_vocab_size):
drafts come from the ranked ids and the requests' own tokens only, greedy output stays the target's, sampled drafts hand the verifier a
distribution over the whole vocabulary that is zero outside the ids, and every wrong setting is refused with
what to do; the ranking itself (training/draft_vocab.py)."""
from __future__ import annotations

import json

import pytest
import torch

from onecat.engine import LLM, SamplingParams
from onecat.engine.args import SpeculativeConfig
from onecat.engine.errors import ConfigError
from onecat.training.draft_vocab import rank_tokens
from tests.embedded_model import EMBEDDED, needs_embedded_model
from tests.test_speculative import write_random_dflash

PROMPTS = ["Once upon a time", "def add(a, b):\n    return", "The capital of France is"]
VOCAB = 49152  # the embedded target's


def test_tokens_are_ranked_by_count_then_id():
    assert rank_tokens([[5, 3, 5], [3, 9, 5], []]) == ([5, 3, 9], [3, 2, 1])


def test_only_a_dflash_drafter_or_an_mtp_head_takes_a_draft_vocabulary():
    with pytest.raises(ValueError, match="draft_vocab_size: only a DFlash drafter or an MTP head"):
        SpeculativeConfig(method="ngram", num_speculative_tokens=3, draft_vocab_size=100)
    with pytest.raises(ValueError, match="draft_vocab_size: only a DFlash drafter or an MTP head"):
        SpeculativeConfig(method="synthetic", num_speculative_tokens=3, acceptance_length=2.0, draft_vocab_size=100)
    for compute in ("dflash", "mtp"):
        SpeculativeConfig(method="synthetic", num_speculative_tokens=3, acceptance_length=2.0, compute=compute,
                          draft_vocab_size=100)
    SpeculativeConfig(method="mtp", num_speculative_tokens=3, draft_vocab_size=100)


def _drafter(tmp_path, ids: list[int] | None):
    folder = write_random_dflash(tmp_path / "dflash", 576, 0, [1, 14, 28], block_size=5)
    if ids is not None:
        (folder / "draft_vocab.json").write_text(json.dumps({"ids": ids, "tokens": 1000}))
    return folder


def _llm(drafter, size: int | None, dtype: str = "float32"):
    spec = {"method": "dflash", "num_speculative_tokens": 4, "model": str(drafter), "disable_when_slower": False}
    if size is not None:
        spec["draft_vocab_size"] = size
    return LLM(EMBEDDED, dtype=dtype, max_model_len=128, enable_prefix_caching=False, speculative_config=spec)


@needs_embedded_model
def test_drafts_come_from_the_draft_vocabulary_and_output_stays_the_targets(tmp_path, embedded_llm):
    ids = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(0))[:3000].tolist()
    drafter = _drafter(tmp_path, ids)
    allowed = set(ids[:2000])
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
              SamplingParams(temperature=0.9, top_p=0.95, seed=3, max_tokens=24, ignore_eos=True)]
    # target-only: the session's float32 engine of the embedded model
    want = [o.token_ids for o in embedded_llm.generate(PROMPTS, params[0])]
    want_sampled = [o.token_ids for o in embedded_llm.generate(PROMPTS, params[1])]
    with _llm(drafter, 2000) as llm:
        proposer = llm.engine.proposer.proposer
        seen = {"drafts": 0, "sampled": 0}
        propose = proposer._propose

        def checked(seqs, budgets):
            own = set().union(*(s.token_ids for s in seqs))
            out = propose(seqs, budgets)
            for seq, draft in zip(seqs, out):  # greedy or sampled, every draft is a token of the round's vocabulary
                tokens = draft.tolist() if isinstance(draft, torch.Tensor) else draft
                assert set(tokens) <= allowed | own
                seen["drafts"] += len(tokens)
                seen["sampled"] += len(tokens) if not seq.params.greedy else 0
            return out

        proposer._propose = checked
        got = [o.token_ids for o in llm.generate(PROMPTS, params[0])]
        got_sampled = [o.token_ids for o in llm.generate(PROMPTS, params[1])]
        described = llm.info()["speculative"]["draft_vocab"]
    assert got == want and got_sampled == want_sampled  # keyed draws: sampled output is target-only's too
    assert seen["drafts"] > 0 and seen["sampled"] > 0
    assert {k: described[k] for k in ("size", "of", "source")} == {
        "size": 2000, "of": VOCAB, "source": "draft_vocab.json (1000 response tokens ranked)"}
    assert described["own_tokens_scored"] > 0


@needs_embedded_model
def test_a_packed_cpu_lm_head_takes_a_draft_vocabulary(tmp_path):
    """The packed target the CPU server runs keeps its LM head only in the int8 kernel's layout: the draft
    vocabulary's rows are unpacked from it, drafts stay inside the round's vocabulary and greedy output is
    target-only's."""
    from onecat.engine.layers.batch_invariant_linear import dense_weight
    from onecat.engine.quant.int4 import int8_matmul

    if int8_matmul.isa() != "AVX512-VNNI":
        pytest.skip("the tied Q8_0 head is one packed 8-bit term with AVX512-VNNI")
    ids = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(1))[:3000].tolist()
    drafter = _drafter(tmp_path, ids)
    spec = {"method": "dflash", "num_speculative_tokens": 4, "model": str(drafter), "disable_when_slower": False,
            "draft_vocab_size": 2000}
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    packed = dict(dtype="float32", quantization="gguf", max_model_len=128, enable_prefix_caching=False)
    with LLM(EMBEDDED, **packed) as base:
        want = [o.token_ids for o in base.generate(PROMPTS, params)]
    with LLM(EMBEDDED, **packed, speculative_config=spec) as llm:
        vocab = llm.engine.proposer.proposer.vocab
        weight = dense_weight(vocab.head)  # (kept in oneDNN's blocked layout)
        assert vocab is not None and weight.shape[0] == 2000
        assert torch.equal(weight[:5], llm.model.lm_head.dense_rows(torch.tensor(ids[:5])))  # the head's values
        got = llm.generate(PROMPTS, params)
    assert [o.token_ids for o in got] == want
    assert sum(o.spec.num_drafts for o in got) > 0


@needs_embedded_model
def test_a_missing_or_short_draft_vocabulary_is_refused_with_the_fix(tmp_path):
    with pytest.raises(ConfigError, match="onecat drafter vocab"):
        _llm(_drafter(tmp_path / "a", None), 100)
    with pytest.raises(ConfigError, match="ask for at most 50"):
        _llm(_drafter(tmp_path / "b", list(range(50))), 100)
    with pytest.raises(ConfigError, match="distinct token ids"):
        _llm(_drafter(tmp_path / "c", [1, 1, 2]), 3)


class _Seq:
    def __init__(self, request_id: str, token_ids: list[int]):
        self.request_id, self.token_ids = request_id, token_ids


def test_a_rounds_own_tokens_follow_each_requests_new_tokens_and_drop_finished_requests():
    from onecat.engine.speculative.draft_vocab import DraftVocab
    head = torch.nn.Linear(8, 50, bias=False)
    vocab = DraftVocab(head, [1, 2, 3], 50, "test")
    a, b = _Seq("a", [1, 7, 2]), _Seq("b", [9, 3])
    vocab.round([a, b])
    assert vocab.round_ids.tolist() == [1, 2, 3, 7, 9]
    torch.testing.assert_close(vocab.own_rows, head.weight[[7, 9]])
    rows_before = vocab.own_rows
    a.token_ids += [1, 9]  # nothing new outside the ranked ids: the round's rows are kept as they are
    vocab.round([a, b])
    assert vocab.own_rows is rows_before and vocab.round_ids.tolist() == [1, 2, 3, 7, 9]
    a.token_ids.append(11)
    vocab.round([a])  # b not in this round: its tokens are not this round's
    assert vocab.round_ids.tolist() == [1, 2, 3, 7, 9, 11]
    vocab.round([b])
    assert vocab.round_ids.tolist() == [1, 2, 3, 9]
    vocab.forget("b")
    vocab.round([_Seq("b", [3])])  # a new request of the same id starts afresh
    assert vocab.round_ids.tolist() == [1, 2, 3] and vocab.own_rows is None
    x = torch.randn(2, 8)
    torch.testing.assert_close(vocab(x), head(x)[:, [1, 2, 3]])
