"""The drafters' CUDA-graph paths end to end on the CPU, capture emulated: a "graph" recomputes its captured step
into the captured output at each replay. A DFlash and an MTP engine then run their rounds through the static
buffers, graph keys and output views as on a GPU (dflash_graphs.py, mtp_graphs.py, round_graphs.py), and must
decode what target-only decodes. The engines run on the CPU on a GPU machine too."""
from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from onecat.engine import LLM, SamplingParams
from onecat.engine.speculative.dflash_graphs import FLUSH_SIZES, DrafterGraphs
from onecat.engine.speculative.mtp_graphs import MTPGraphs
from onecat.engine.speculative.round_graphs import ContextGraphs
from tests.test_speculative import write_random_dflash
from tests.tiny_models import make_tiny_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
PROMPTS = [[5, 9, 3, 7, 5, 9, 3], [1, 2, 3, 4, 1, 2, 3, 4, 1], [8, 8, 8]]


class _Replayed:
    def __init__(self, step, out: torch.Tensor):
        self.step, self.out = step, out

    def replay(self) -> None:
        self.out.copy_(self.step())


@pytest.fixture
def emulated_capture(monkeypatch):
    def capture(self, step, label):
        out = step()
        return _Replayed(step, out), out

    monkeypatch.setattr(ContextGraphs, "capture", capture)


def _with_graphs(graphs):
    graphs.capturing = True  # as on a GPU
    return graphs


@contextmanager
def dflash_through_graphs(tmp_path: Path):
    """(target-only's greedy tokens of PROMPTS, an open DFlash engine on the same tiny target whose drafter runs
    its rounds through the graph buffers, capture emulated)."""
    target = make_tiny_model("llama", tmp_path / "target", vocab_size=48, num_hidden_layers=2)
    drafter = write_random_dflash(tmp_path / "dflash", 64, 0, [0, 1], block_size=4)
    with LLM(str(target), max_model_len=128, device="cpu") as plain:
        want = [o.token_ids for o in plain.generate(PROMPTS, GREEDY)]
    spec = {"method": "dflash", "num_speculative_tokens": 3, "model": str(drafter), "disable_when_slower": False}
    with LLM(str(target), max_model_len=128, device="cpu", speculative_config=spec) as llm:
        proposer = llm.engine.proposer.proposer
        proposer.graphs = _with_graphs(DrafterGraphs(proposer.drafter, proposer.embed, proposer.cache,
                                                     torch.device("cpu")))
        yield want, llm


def test_dflash_rounds_through_the_graph_buffers_decode_as_target_only(tmp_path, emulated_capture):
    with dflash_through_graphs(tmp_path) as (want, llm):
        proposer = llm.engine.proposer.proposer
        outs = llm.generate(PROMPTS, GREEDY)
        report = proposer.graphs.report()
    assert [o.token_ids for o in outs] == want
    assert report["disabled_reason"] is None and report["replays"] > 0 and report["flush_replays"] > 0
    assert any(rows > len(PROMPTS) for rows, _ in report["captured"])  # three requests padded to a bucket of four


def test_dflash_graphs_captured_ahead_leave_nothing_to_capture_while_decoding(tmp_path, emulated_capture):
    """At start-up the drafter captures every (rows, context) bucket its engine can reach and every projection
    size; decoding then replays only, so no decode step times a capture."""
    target = make_tiny_model("llama", tmp_path / "target", vocab_size=48, num_hidden_layers=2)
    drafter = write_random_dflash(tmp_path / "dflash", 64, 0, [0, 1], block_size=4)
    with LLM(str(target), max_model_len=128, device="cpu") as plain:
        want = [o.token_ids for o in plain.generate(PROMPTS, GREEDY)]
    spec = {"method": "dflash", "num_speculative_tokens": 3, "model": str(drafter), "disable_when_slower": False}
    with LLM(str(target), max_model_len=128, max_num_seqs=3, device="cpu", speculative_config=spec) as llm:
        proposer = llm.engine.proposer.proposer
        graphs = proposer.graphs = _with_graphs(DrafterGraphs(proposer.drafter, proposer.embed, proposer.cache,
                                                              torch.device("cpu")))
        with torch.inference_mode():
            ahead = graphs.capture_ahead(3, 128)
        assert sorted(graphs.graphs) == [(1, 256), (2, 256), (4, 256)]  # three requests pad to four rows
        assert ahead == 3 + len(FLUSH_SIZES) == proposer.graph_captures
        outs = llm.generate(PROMPTS, GREEDY)
        assert graphs.captures == ahead and graphs.replays > 0 and graphs.flush_replays > 0
    assert [o.token_ids for o in outs] == want


def test_greedy_mtp_rounds_through_the_graph_buffers_decode_as_target_only(emulated_capture):
    path = str(Path(__file__).parent / "data" / "tiny-qwen35")  # carries an MTP head
    settings = dict(max_model_len=128, max_num_seqs=4, device="cpu")  # the emulation runs on the CPU, GPU or not
    with LLM(path, **settings) as plain:
        want = [o.token_ids for o in plain.generate(PROMPTS, GREEDY)]
    spec = {"method": "mtp", "num_speculative_tokens": 3, "disable_when_slower": False}
    with LLM(path, speculative_config=spec, **settings) as llm:
        proposer = llm.engine.proposer.proposer
        proposer.graphs = _with_graphs(MTPGraphs(proposer.head, proposer.embed, proposer.lm_head, proposer.cache,
                                                 2 * llm.model_config.hidden_size, torch.device("cpu")))
        outs = llm.generate(PROMPTS, GREEDY)
        report = proposer.graphs.report()
        described = llm.info()["speculative"]
    assert [o.token_ids for o in outs] == want
    assert report["disabled_reason"] is None and report["replays"] > 0
    assert described["cuda_graphs"] and described["cuda_graph_replays"] == report["replays"]
    assert described["cuda_graph_captures"] == len(report["captured"]) > 0  # each captured once, counted


def test_sampled_mtp_rounds_through_the_graph_buffers_decode_as_target_only(emulated_capture):
    """Sampled requests' drafts are keyed draws inside the round's graph (the keys a static buffer, the settings in
    the graph's key): seeded sampled output equals target-only's, rounds replay graphs once their key is met
    again, and a mixed greedy + sampled batch decodes alike."""
    path = str(Path(__file__).parent / "data" / "tiny-qwen35")
    settings = dict(max_model_len=128, max_num_seqs=4, device="cpu")
    params = [SamplingParams(temperature=0.9, top_k=20, top_p=0.9, seed=3, max_tokens=24, ignore_eos=True),
              SamplingParams(temperature=1.0, top_p=0.8, seed=4, max_tokens=24, ignore_eos=True), GREEDY]
    with LLM(path, **settings) as plain:
        want = [o.token_ids for o in plain.generate(PROMPTS, params)]
    spec = {"method": "mtp", "num_speculative_tokens": 3, "disable_when_slower": False}
    with LLM(path, speculative_config=spec, **settings) as llm:
        eager = llm.generate(PROMPTS, params)  # no graphs on the CPU: every round drafts eagerly
        proposer = llm.engine.proposer.proposer
        proposer.graphs = _with_graphs(MTPGraphs(proposer.head, proposer.embed, proposer.lm_head, proposer.cache,
                                                 2 * llm.model_config.hidden_size, torch.device("cpu"), max_steps=3))
        outs = llm.generate(PROMPTS, params)
        report = proposer.graphs.report()
    assert [o.token_ids for o in outs] == [o.token_ids for o in eager] == want
    assert report["disabled_reason"] is None and report["replays"] > 0
    assert any(key[3] for key in report["captured"]), report["captured"]  # a round with sampled rows was captured
    # the same drafts as the eager rounds (drawn with the same keys), so the same acceptance
    assert [(o.spec.num_drafts, o.spec.num_accepted_tokens) for o in outs] == \
        [(o.spec.num_drafts, o.spec.num_accepted_tokens) for o in eager]
    assert sum(o.spec.num_accepted_tokens for o in outs) > 0
