"""A block drafter's next round drafted before the verify step is read (engine/speculative/draft_ahead.py), on the
CPU: the drafts it hands out equal a fresh round's over the request's whole context (greedy and sampled), the
engine decodes target-only's tokens, and a request whose state moved on is drafted afresh."""
from __future__ import annotations

import pytest
import torch

from onecat.engine import LLM, SamplingParams
from onecat.engine.core.keyed_draws import row_keys
from onecat.engine.core.sampler import sample
from onecat.engine.speculative.draft_ahead import AHEAD_FLAG, ahead_wanted
from tests.test_dflash_hybrid import steer_drafts
from tests.test_dflash_runtime import DraftChecker
from tests.test_drafter_graph_rounds import GREEDY, PROMPTS, dflash_through_graphs, emulated_capture  # noqa: F401
from tests.test_speculative import write_random_dflash
from tests.tiny_models import make_tiny_model


class AheadChecker(DraftChecker):
    """Keeps every tapped row by position (DraftChecker) and, whenever the proposer hands out drafts it drafted
    ahead, recomputes them over the request's whole context: logits close, tokens equal."""

    def __init__(self, proposer):
        super().__init__(proposer)
        self.checked, self.fresh, self.sampled = 0, 0, 0

    def propose(self, seqs, budgets):
        ahead = dict(self.proposer.ahead)
        out = self._propose(seqs, budgets)
        for seq, budget, draft in zip(seqs, budgets, out):
            a = ahead.get(seq.request_id)
            if a is None or a.anchor != seq.num_tokens - 1:
                self.fresh += 1
                continue
            n = min(budget, self.proposer.k)
            want = self.recompute(seq, n)
            torch.testing.assert_close(a.logits[:n].float(), want, rtol=1e-4, atol=1e-4)
            if seq.params.greedy:
                assert list(draft) == want.argmax(-1).tolist()
            else:  # drawn with the keys of the positions the drafts will occupy
                keys = row_keys([seq.seed] * n, list(range(seq.num_tokens, seq.num_tokens + n)), want.device)
                assert list(draft) == sample(want, [seq.params] * n, keys)
                self.sampled += 1
            self.checked += 1
        return out


@pytest.mark.parametrize("device,batch", [("cpu", 1), ("cpu", 3), pytest.param("cuda", 3, marks=pytest.mark.gpu)])
def test_drafts_ahead_equal_a_fresh_round_and_decode_as_target_only(device, batch, tmp_path, monkeypatch):
    """On a GPU (float32) the round drafted ahead runs through the drafter's CUDA graphs and the verified read
    behind its event."""
    monkeypatch.setenv(AHEAD_FLAG, "1")
    target = make_tiny_model("llama", tmp_path / "target", vocab_size=48, num_hidden_layers=2)
    drafter = write_random_dflash(tmp_path / "dflash", 64, 0, [0, 1], block_size=4)
    prompts = PROMPTS[:batch]
    with LLM(str(target), max_model_len=128, device=device, dtype="float32") as plain:
        want = [o.token_ids for o in plain.generate(prompts, GREEDY)]
    spec = {"method": "dflash", "num_speculative_tokens": 3, "model": str(drafter), "disable_when_slower": False}
    with LLM(str(target), max_model_len=128, device=device, dtype="float32", speculative_config=spec) as llm:
        proposer = llm.engine.proposer.proposer
        assert proposer.drafts_ahead
        checker = AheadChecker(proposer)
        steer_drafts(proposer, prompts, want)  # acceptance that moves from round to round; some plain steps
        outs = llm.generate(prompts, GREEDY)
        assert not proposer.ahead and proposer.cache.entries == {}  # finished requests leave nothing behind
        described = llm.info()["speculative"]
        assert described["drafts_ahead"] and described["rounds_drafted_ahead"] == checker.checked
    assert [o.token_ids for o in outs] == want
    assert checker.checked >= 5 and checker.fresh > 0  # drafted ahead, and afresh after the plain steps
    assert sum(o.spec.num_accepted_tokens for o in outs) > 0


def test_sampled_requests_are_drafted_ahead_and_decode_as_target_only(tmp_path, monkeypatch):
    """Sampled requests (top-k, and temperature alone) beside a greedy one: their rounds are drafted ahead too, each
    draft the keyed draw a fresh round makes, and every request's tokens are target-only's for its seed."""
    monkeypatch.setenv(AHEAD_FLAG, "1")
    target = make_tiny_model("llama", tmp_path / "target", vocab_size=48, num_hidden_layers=2)
    drafter = write_random_dflash(tmp_path / "dflash", 64, 0, [0, 1], block_size=4)
    params = [GREEDY, SamplingParams(temperature=0.8, top_k=8, seed=3, max_tokens=GREEDY.max_tokens, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=4, max_tokens=GREEDY.max_tokens, ignore_eos=True)]
    with LLM(str(target), max_model_len=128, dtype="float32") as plain:
        want = [o.token_ids for o in plain.generate(PROMPTS[:3], params)]
    spec = {"method": "dflash", "num_speculative_tokens": 3, "model": str(drafter), "disable_when_slower": False}
    with LLM(str(target), max_model_len=128, dtype="float32", speculative_config=spec) as llm:
        checker = AheadChecker(llm.engine.proposer.proposer)
        outs = llm.generate(PROMPTS[:3], params)
    assert [o.token_ids for o in outs] == want
    assert checker.sampled >= 5


@pytest.mark.parametrize("flag", [None, "0"])
def test_on_a_cpu_without_the_flag_nothing_is_drafted_ahead(flag, tmp_path, monkeypatch):
    """The default on a CPU (and =0 anywhere): no round is launched ahead."""
    if flag is None:
        monkeypatch.delenv(AHEAD_FLAG, raising=False)
    else:
        monkeypatch.setenv(AHEAD_FLAG, flag)
    target = make_tiny_model("llama", tmp_path / "target", vocab_size=48, num_hidden_layers=2)
    drafter = write_random_dflash(tmp_path / "dflash", 64, 0, [0, 1], block_size=4)
    spec = {"method": "dflash", "num_speculative_tokens": 3, "model": str(drafter), "disable_when_slower": False}
    with LLM(str(target), max_model_len=128, device="cpu", speculative_config=spec) as llm:
        proposer = llm.engine.proposer.proposer
        calls = []
        proposer.draft_ahead = lambda *a: calls.append(a)
        llm.generate(PROMPTS, GREEDY)
    assert not proposer.drafts_ahead and not calls


@pytest.mark.parametrize("flag,on_gpu,on_cpu", [(None, True, False), ("0", False, False), ("1", True, True)])
def test_drafting_ahead_is_the_default_on_a_gpu_only(flag, on_gpu, on_cpu, monkeypatch):
    if flag is None:
        monkeypatch.delenv(AHEAD_FLAG, raising=False)
    else:
        monkeypatch.setenv(AHEAD_FLAG, flag)
    assert ahead_wanted(torch.device("cuda")) is on_gpu and ahead_wanted(torch.device("cpu")) is on_cpu


def test_drafts_ahead_through_the_graph_buffers(tmp_path, monkeypatch, emulated_capture):
    """The graph path (DrafterGraphs.run with the step's projected rows behind each held context in the static
    buffer, the lengths from the device), capture emulated on the CPU: the same checks."""
    monkeypatch.setenv(AHEAD_FLAG, "1")
    with dflash_through_graphs(tmp_path) as (want, llm):
        proposer = llm.engine.proposer.proposer
        ahead_rounds = []
        run = proposer.graphs.run
        proposer.graphs.run = lambda *a: (ahead_rounds.append(1) if len(a) > 4 else None) or run(*a)
        checker = AheadChecker(proposer)
        steer_drafts(proposer, PROMPTS, want)
        outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == want
    assert checker.checked >= 5 and len(ahead_rounds) > 0 and proposer.graphs.replays > 0
