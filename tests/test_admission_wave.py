"""admission_wave: while sequences decode, waiting ones start only once a wave of them has free slots, then
together over as many steps as the token budget needs; the tokens never change, and fewer steps carry prompt
rows (on CUDA those run eagerly where pure decode steps replay graphs)."""
from __future__ import annotations

import pytest

from onecat.engine import LLM, SamplingParams
from onecat.engine.args import EngineArgs
from onecat.engine.core.block_manager import BlockManager
from onecat.engine.core.scheduler import Scheduler
from onecat.engine.core.sequence import Sequence
from onecat.engine.errors import ConfigError


def _scheduler(wave: int, seqs: int = 4, budget: int = 64) -> Scheduler:
    cfg = EngineArgs(model="x", max_num_seqs=seqs, admission_wave=wave, max_num_batched_tokens=budget)
    return Scheduler(cfg, BlockManager(256, 16, False))


def _step(sched: Scheduler) -> list[str]:
    """One schedule() applied as the engine would: computed tokens advance, a finished prompt gets a token.
    Returns the ids of the sequences that started this step."""
    started = []
    for s in sched.schedule().scheduled:
        if s.seq.num_computed_tokens == 0:
            started.append(s.seq.request_id)
        s.seq.num_computed_tokens += s.num_new_tokens
        if s.seq.num_computed_tokens == s.seq.num_tokens:
            s.seq.token_ids.append(7)
    return started


def _add(sched: Scheduler, n: int, prompt_len: int = 8) -> None:
    for i in range(n):
        sched.add(Sequence(f"r{len(sched.waiting) + len(sched.running)}-{i}", None, [3] * prompt_len,
                           SamplingParams(), 0))


def _finish(sched: Scheduler, n: int) -> None:
    for seq in list(sched.running[:n]):
        sched.finish(seq, "length")


def test_waiting_sequences_start_in_waves_while_others_decode():
    sched = _scheduler(wave=3)
    _add(sched, 9)
    assert len(_step(sched)) == 4  # nothing running: every slot fills at once
    _finish(sched, 2)  # two slots free, a wave is three
    assert not sched.admits_waiting()
    assert _step(sched) == []
    _finish(sched, 1)
    assert sched.admits_waiting()
    assert len(_step(sched)) == 3
    _finish(sched, 2)  # two wait: a wave is then all of them
    assert len(_step(sched)) == 2
    assert not sched.waiting and not sched.admits_waiting()


def test_a_wave_goes_on_over_steps_the_token_budget_cuts():
    sched = _scheduler(wave=4, seqs=8, budget=40)
    _add(sched, 8, prompt_len=4)
    assert len(_step(sched)) == 8
    _add(sched, 8, prompt_len=16)
    _finish(sched, 4)
    assert len(_step(sched)) == 3  # 4 decodes + 16 + 16 + the first 4 tokens of the third: the budget ends the step
    assert len(_step(sched)) == 1  # one slot left of the same wave: filled on the next step
    assert _step(sched) == []
    _finish(sched, 3)  # three free of a wave of four: the newcomers wait
    assert _step(sched) == []
    _finish(sched, 1)
    assert [len(_step(sched)) for _ in range(2)] == [3, 1]


def test_a_wave_of_one_admits_as_soon_as_a_slot_frees():
    sched = _scheduler(wave=1)
    _add(sched, 6)
    assert len(_step(sched)) == 4
    _finish(sched, 1)
    assert sched.admits_waiting()
    assert len(_step(sched)) == 1


def test_a_wave_larger_than_the_slots_is_refused_by_name():
    with pytest.raises(ConfigError, match="admission_wave 9 exceeds max_num_seqs 8"):
        EngineArgs.create(model="x", max_num_seqs=8, admission_wave=9)


def test_waves_keep_every_token_and_cut_the_steps_with_prompt_rows():
    prompts = [{"prompt_token_ids": [(11 * i + j) % 900 + 5 for j in range(6 + i % 5)]} for i in range(20)]
    params = [SamplingParams(temperature=0.0, max_tokens=3 + (7 * i) % 13, ignore_eos=True) for i in range(20)]
    runs = {}
    for wave in (1, 4):
        with LLM("random:tiny-llama", device="cpu", load_format="dummy", max_model_len=128, max_num_seqs=6,
                 admission_wave=wave, enable_prefix_caching=False) as llm:
            outs = llm.generate(prompts, params)
            runs[wave] = ([o.token_ids for o in outs], dict(llm.engine.stats), llm.info()["admission_wave"])
    assert runs[4][0] == runs[1][0]
    assert [len(t) for t in runs[4][0]] == [p.max_tokens for p in params]
    assert runs[4][2] == 4 and runs[1][2] == 1
    assert runs[4][1]["prefill_steps"] < runs[1][1]["prefill_steps"], (runs[1][1], runs[4][1])
