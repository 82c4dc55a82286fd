"""Speculative verify steps in CUDA graphs at every draft length (GPU only; skipped without one): rows of
0..k drafts share the verify graph of width 1 + k, and give the same tokens and logprobs as the eager
steps, at batch 1 and above, with the drafts' acceptance varying, whether the drafts come as host lists or stay
on the device (as DFlash's and MTP's do)."""
from __future__ import annotations

import itertools

import pytest
import torch

from onecat.engine.speculative.base import Proposer

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

K = 4
PROMPTS = [" ".join(f"t{(i * 11 + j * 5) % 300 + 1}" for j in range(n)) for i, n in enumerate((6, 41, 97))]


class CyclingDrafts(Proposer):
    """Proposes the target's known continuation, cut to a length that cycles through 0..k, its last draft
    made wrong on every third call: every draft length and every acceptance occur."""

    name = "cycling"

    def __init__(self, reference, vocab_size: int, on_device: bool = False):
        super().__init__(K)
        self.reference, self.vocab, self.drafts_on_device = reference, vocab_size, on_device
        self.calls = itertools.count()

    def propose(self, seqs, budgets):
        out = []
        for seq, budget in zip(seqs, budgets):
            call = next(self.calls)
            n = min(call % (K + 1), budget)
            known = self.reference[tuple(seq.token_ids[:seq.num_prompt_tokens])][seq.num_output_tokens:][:n]
            if known and call % 3 == 0:
                known = known[:-1] + [(known[-1] + 1) % self.vocab]
            out.append(torch.tensor(known, dtype=torch.long, device="cuda") if self.drafts_on_device else known)
        return out


def _run(llm, prompts, params, reference, graphs: bool, on_device: bool = False):
    with llm.cuda_graphs_replaced(graphs):
        with llm.proposer_swapped(CyclingDrafts(reference, llm.model_config.vocab_size, on_device)):
            outs = llm.generate(prompts, params)
            report = llm.cuda_graph_report()
    return outs, report


@pytest.mark.parametrize("on_device", [False, True], ids=["host_drafts", "device_drafts"])
@pytest.mark.parametrize("batched", [False, True])
def test_verify_graphs_of_every_draft_length_match_eager(tmp_path, batched, on_device):
    from onecat.engine import LLM, SamplingParams
    from tests.tiny_models import make_tiny_model

    model_dir = make_tiny_model("llama", tmp_path / "tiny", hidden_size=256, num_attention_heads=8,
                                num_key_value_heads=2, intermediate_size=512)
    llm = LLM(str(model_dir), device="cuda", dtype="float16", cuda_graph="full", max_model_len=256,
              max_num_seqs=4, kv_cache_memory_gb=0.25, async_scheduling=False)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=40, logprobs=2, ignore_eos=True)
        prompts = PROMPTS if batched else PROMPTS[:1]
        ref_outs = llm.generate(prompts, params)
        reference = {tuple(o.prompt_token_ids): o.token_ids for o in ref_outs}
        eager, eager_report = _run(llm, prompts, params, reference, graphs=False, on_device=on_device)
        graphed, report = _run(llm, prompts, params, reference, graphs=True, on_device=on_device)
    finally:
        llm.close()
    assert eager_report["verify_replays"] == 0
    assert report["verify_replays"] > 0, report
    for e, g, r in zip(eager, graphed, ref_outs[:len(eager)]):
        assert g.token_ids == e.token_ids == r.token_ids
        assert g.spec.num_draft_tokens == e.spec.num_draft_tokens > 0
        assert g.spec.num_accepted_tokens == e.spec.num_accepted_tokens
        for le, lg in zip(e.logprobs, g.logprobs):
            assert le.keys() == lg.keys()
            assert [lg[t] for t in le] == pytest.approx([le[t] for t in le], abs=2e-3)


def test_draft_model_steps_replay_the_draft_engines_graphs(tmp_path):
    """With cuda_graph full, the draft model's decode steps replay its own engine's graphs, and greedy
    speculation keeps target-only's tokens."""
    from onecat.engine import LLM, SamplingParams
    from tests.tiny_models import make_tiny_model

    target = make_tiny_model("llama", tmp_path / "target", hidden_size=256, num_attention_heads=8,
                             num_key_value_heads=2, intermediate_size=512)
    draft = make_tiny_model("llama", tmp_path / "draft", num_hidden_layers=1)
    settings = dict(device="cuda", dtype="float16", cuda_graph="full", max_model_len=256, max_num_seqs=4,
                    kv_cache_memory_gb=0.25)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    with LLM(str(target), **settings) as plain:
        want = [o.token_ids for o in plain.generate(PROMPTS, params)]
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3,
            "disable_when_slower": False}
    with LLM(str(target), speculative_config=spec, **settings) as llm:
        got = [o.token_ids for o in llm.generate(PROMPTS, params)]
        drafter = llm.info()["speculative"]
    assert got == want
    assert drafter["cuda_graph"]["used"] and drafter["cuda_graph"]["replays"] > 0, drafter


def test_prompt_lookup_is_asked_while_pipelined_steps_are_in_flight(tmp_path):
    """An n-gram engine (gate on) over text its lookups never match decodes in the one-step-ahead pipeline: the
    proposer's turns are taken while a step is in flight, not by draining it, and the tokens are target-only's."""
    from onecat.engine import LLM, SamplingParams
    from tests.tiny_models import make_tiny_model

    model_dir = make_tiny_model("llama", tmp_path / "tiny", hidden_size=256, num_attention_heads=8,
                                num_key_value_heads=2, intermediate_size=512)
    settings = dict(device="cuda", dtype="float16", cuda_graph="full", max_model_len=512, max_num_seqs=4,
                    kv_cache_memory_gb=0.25)
    params = SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True)
    with LLM(str(model_dir), **settings) as plain:
        want = [o.token_ids for o in plain.generate(PROMPTS, params)]
    never = 10_000  # an n-gram longer than any sequence: nothing is ever found
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": never, "prompt_lookup_max": never}
    with LLM(str(model_dir), speculative_config=spec, **settings) as llm:
        got = [o.token_ids for o in llm.generate(PROMPTS, params)]
        info = llm.info()
    assert got == want
    assert info["speculative"]["pipelined_lookups"] > 0, info["speculative"]
    assert info["async_scheduling"]["launches"] > 0, info["async_scheduling"]
