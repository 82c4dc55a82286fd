"""Drafts left on the device (a DFlash or MTP drafter on a GPU): the verify step's input ids take them from
there and the verifier compares them there, so the host reads nothing between drafting and verifying. Every
path must give what host lists give. On this CPU the drafters' tensors stand in for device tensors."""
from __future__ import annotations

import pytest
import torch

from onecat.engine import LLM, SamplingParams
from onecat.engine.speculative.dflash import DFlashProposer
from onecat.engine.speculative.verifier import DraftBlock, verify_blocks
from onecat.engine.worker.cuda_graph import _write_device_drafts
from tests.test_speculative import write_random_dflash
from tests.tiny_models import make_tiny_model

GREEDY = SamplingParams(temperature=0.0)
SAMPLED = SamplingParams(temperature=1.0)


def _blocks(as_tensor):
    g = torch.Generator().manual_seed(3)
    out = []
    for i, (k, params) in enumerate([(4, GREEDY), (2, SAMPLED), (1, GREEDY), (3, SAMPLED), (4, SAMPLED)]):
        logits = torch.randn(k + 1, 7, generator=g) * 2
        draft = logits.argmax(dim=-1)[:k].tolist()
        draft[k // 2] = (draft[k // 2] + i) % 7  # some rejected, some accepted
        d = torch.tensor(draft) if as_tensor(i) else draft
        out.append(DraftBlock(d, logits, params, 10 + i, 20))
    return out


@pytest.mark.parametrize("as_tensor", [lambda i: True, lambda i: i % 2 == 0], ids=["all", "mixed"])
def test_drafts_given_as_tensors_verify_like_host_lists(as_tensor):
    assert verify_blocks(_blocks(as_tensor)) == verify_blocks(_blocks(lambda i: False))


def test_device_drafts_fill_the_end_of_their_verify_rows():
    ids = torch.full((3, 5), -1)
    _write_device_drafts(ids, [torch.tensor([7, 8]), torch.tensor([9, 10]), torch.tensor([11, 12])])
    assert ids[:, 3:].tolist() == [[7, 8], [9, 10], [11, 12]] and (ids[:, :3] == -1).all()
    ids = torch.full((3, 5), -1)
    _write_device_drafts(ids, [torch.tensor([1, 2, 3, 4]), None, torch.tensor([5])])
    assert ids.tolist() == [[-1, 1, 2, 3, 4], [-1] * 5, [-1, -1, -1, -1, 5]]


def test_a_dflash_engine_whose_drafts_stay_on_the_device_decodes_as_target_only(tmp_path, monkeypatch):
    target = make_tiny_model("llama", tmp_path / "target", vocab_size=48, num_hidden_layers=2)
    drafter = write_random_dflash(tmp_path / "dflash", 64, 0, [0, 1], block_size=4)
    prompts = [[5, 9, 3, 7, 5, 9, 3], [1, 2, 3, 4, 1, 2, 3, 4, 1], [8, 8, 8]]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    with LLM(str(target), max_model_len=128) as plain:
        want = [o.token_ids for o in plain.generate(prompts, params)]
    kinds = []
    propose = DFlashProposer.propose

    def spy(self, seqs, budgets):
        out = propose(self, seqs, budgets)
        kinds.extend(type(d) for d in out)
        return out

    monkeypatch.setattr(DFlashProposer, "drafts_on_device", property(lambda self: True))
    monkeypatch.setattr(DFlashProposer, "propose", spy)
    spec = {"method": "dflash", "num_speculative_tokens": 3, "model": str(drafter)}
    with LLM(str(target), max_model_len=128, speculative_config=spec) as llm:
        outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == want
    assert sum(o.spec.num_drafts for o in outs) > 0 and set(kinds) == {torch.Tensor}


def test_a_verify_graph_step_leaves_room_for_device_drafts_and_keeps_host_ones():
    """Host ids hold 0 where a row's drafts are on the device; those rows' tensors ride along for the replay to
    copy in; rows of host drafts are written whole."""
    from types import SimpleNamespace

    from onecat.engine.worker.cuda_graph import DecodeGraphs

    graphs = SimpleNamespace(states=None, verify_gemv_rows=1)
    on_dev = torch.tensor([21, 22])
    rows = [(SimpleNamespace(token_ids=[5, 6, 7], draft_tokens=on_dev, block_table=[1]), 2),
            (SimpleNamespace(token_ids=[8, 9], draft_tokens=[31], block_table=[2]), 1)]
    step = DecodeGraphs.graph_step(graphs, rows, size=2, q=3, drafts=[2, 1])
    assert step.ids == [7, 0, 0, 0, 9, 31]  # row 0: token + two device drafts; row 1: lead pad, token, draft
    assert torch.equal(step.device_drafts[0], on_dev) and step.device_drafts[1] is None
    ids = torch.tensor(step.ids).view(2, 3)
    _write_device_drafts(ids, step.device_drafts)
    assert ids.flatten().tolist() == [7, 21, 22, 0, 9, 31]


def test_small_values_reach_the_host_device_unchanged():
    from onecat.engine.transfers import to_device

    got = to_device([[1, 2], [3, 4]], "cpu", torch.int32)
    assert got.dtype == torch.int32 and got.tolist() == [[1, 2], [3, 4]]
    assert to_device(range(3), torch.device("cpu")).tolist() == [0, 1, 2]


@pytest.mark.gpu
def test_small_values_go_to_the_gpu_without_waiting_for_queued_kernels():
    """After ~tens of ms of queued matmuls, to_device returns while they still run (the stream is busy), and the
    values arrive; torch.tensor(device=cuda), for contrast, waits for them."""
    from onecat.engine.transfers import to_device

    a = torch.randn(4096, 4096, device="cuda", dtype=torch.float16)
    stream = torch.cuda.current_stream()

    def busy():
        torch.cuda.synchronize()
        for _ in range(40):
            a @ a

    busy()
    got = to_device(list(range(64)), "cuda")
    assert not stream.query()  # the host did not wait for the queued work
    assert got.tolist() == list(range(64))
    busy()
    torch.tensor(list(range(64)), device="cuda")
    assert stream.query()  # the synchronous copy did
