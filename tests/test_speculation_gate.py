"""The speculation gate (engine/speculative/controller.py) and the acceptance-controlled proposer
(speculative/synthetic.py): decisions from given timings, the engine's plumbing into them, exact tokens
either way, and an acceptance length that is exactly the one asked for."""
from __future__ import annotations

import math

import pytest

from onecat.engine.speculative.controller import (MAX_LOSING_PROBE_EVERY, MAX_PROBE_EVERY, PROBE_COST, WARMUP,
                                                  SpeculationGate)


def _feed(gate: SpeculationGate, batch: int, steps: int, plain_s: float, round_s: float, tokens: float) -> list[bool]:
    """Run `steps` decisions, timing each step as the engine would; returns the decisions."""
    decisions = []
    for _ in range(steps):
        drafted = gate.wants_drafts(batch)
        decisions.append(drafted)
        gate.record(batch, drafted, round_s if drafted else plain_s, tokens if drafted else 1.0)
    return decisions


def test_rounds_that_lose_turn_drafting_off_but_are_probed():
    gate = SpeculationGate(probe_every=16)
    decisions = _feed(gate, 1, 200, plain_s=1.0, round_s=1.5, tokens=1.2)  # 0.8 tokens/s against 1.0
    assert gate.pays(1) is False
    tail = decisions[50:]
    assert 0 < sum(tail) <= len(tail) // 16 + 1  # drafting only as a probe, once every probe_every steps
    assert gate.report()["per_batch_size_up_to"][1]["drafting_pays"] is False
    # between probes the plain steps may run pipelined; the step before a probe may not
    paused = []
    for _ in range(40):
        paused.append(gate.paused(1))
        drafted = gate.wants_drafts(1)
        assert paused[-1] is not drafted or not paused[-1]
        gate.record(1, drafted, 1.5 if drafted else 1.0, 1.2 if drafted else 1.0)
    assert sum(paused) >= 40 - 2 * (40 // 16 + 1)


def test_rounds_that_win_keep_drafting_and_plain_steps_are_probed():
    gate = SpeculationGate(probe_every=16)
    decisions = _feed(gate, 8, 200, plain_s=1.0, round_s=1.2, tokens=2.0)  # 1.67 tokens/s against 1.0
    assert gate.pays(8) is True
    tail = decisions[50:]
    assert len(tail) - len(tail) // 16 - 1 <= sum(tail) < len(tail)


def test_each_batch_size_is_judged_on_its_own():
    gate = SpeculationGate()
    _feed(gate, 1, 40, plain_s=1.0, round_s=1.1, tokens=2.0)
    _feed(gate, 32, 40, plain_s=1.0, round_s=3.0, tokens=2.0)
    assert gate.pays(1) is True and gate.pays(32) is False


def test_a_new_batch_size_starts_from_a_smaller_ones_losing_verdict_and_probes_it():
    gate = SpeculationGate(probe_every=16)
    _feed(gate, 1, 100, plain_s=1.0, round_s=8.0, tokens=2.0)  # loses badly
    assert gate.pays(1) is False
    decisions = _feed(gate, 8, 15, plain_s=1.1, round_s=8.5, tokens=2.0)
    assert gate.pays(8) is False and not any(decisions)  # no rounds to learn what batch 1 already said
    decisions = _feed(gate, 8, 20, plain_s=1.1, round_s=2.0, tokens=3.0)  # drafting now pays at batch 8
    assert decisions.count(True) >= 1  # probed within probe_every steps ...
    _feed(gate, 8, 300, plain_s=1.1, round_s=2.0, tokens=3.0)
    assert gate.pays(8) is True  # ... and the probes move its own verdict (spaced as any losing bucket's)


def test_a_winning_verdict_is_not_carried_to_a_larger_batch_size():
    gate = SpeculationGate(probe_every=16)
    _feed(gate, 1, 60, plain_s=1.0, round_s=1.2, tokens=2.0)
    assert gate.pays(1) is True
    assert gate.pays(8) is None and gate.wants_drafts(8)  # measured afresh, rounds first


def test_first_samples_are_not_averaged_and_nothing_is_judged_before_both_modes_ran():
    gate = SpeculationGate()
    assert gate.pays(1) is None
    for _ in range(WARMUP):
        assert gate.wants_drafts(1)  # rounds are measured first
        gate.record(1, True, 100.0, 1.0)  # capture-sized outliers are left out
    assert gate.pays(1) is None
    _feed(gate, 1, 30, plain_s=1.0, round_s=1.1, tokens=3.0)
    assert gate.pays(1) is True


def test_a_proposer_that_finds_nothing_is_asked_less_often():
    gate = SpeculationGate(probe_every=8)
    calls = 0
    for _ in range(100):
        if gate.wants_drafts(1):
            calls += 1
            gate.proposed(False)  # nothing found: the step runs plain
        else:
            assert gate.paused(1)  # a backed-off step may run in the decode pipeline
        gate.record(1, False, 1.0, 1.0)
    assert 100 // 9 <= calls <= 100 // 8 + 6  # backs off 1, 2, 4, 8, 8, ... steps
    assert gate.report()["steps"]["proposer_skipped"] == 100 - calls
    gate.proposed(True)
    assert gate.wants_drafts(1) and not gate.paused(1)  # a draft found ends the back-off


def test_a_disabled_gate_always_drafts():
    gate = SpeculationGate(enabled=False)
    assert all(_feed(gate, 1, 50, plain_s=1.0, round_s=9.0, tokens=1.0))


# ---- the engine's side: plumbing, exactness, acceptance ------------------------------------------------

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, once upon a time, once upon a time,"]


@pytest.fixture(scope="module")
def engine(embedded_path):
    from onecat.engine import LLM, SamplingParams

    llm = LLM(str(embedded_path), dtype="float32", max_model_len=512, seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=24, logprobs=1)
    reference = {tuple(o.prompt_token_ids): o for o in llm.generate(PROMPTS, params)}
    yield llm, params, reference
    llm.close()


def _synthetic(llm, reference, accepted: int, k: int = 4):
    from onecat.engine.speculative.ngram import NgramProposer
    from onecat.engine.speculative.synthetic import SyntheticProposer

    def continuation(seq):
        return reference[tuple(seq.token_ids[:seq.num_prompt_tokens])].token_ids[seq.num_output_tokens:]

    return SyntheticProposer(NgramProposer(k), accepted, continuation, llm.model_config.vocab_size)


@pytest.mark.parametrize("accepted", [0, 2, 4])
def test_synthetic_proposer_gives_exactly_the_asked_acceptance_and_the_target_tokens(engine, accepted):
    llm, params, reference = engine
    with llm.proposer_swapped(_synthetic(llm, reference, accepted)):
        outs = llm.generate(PROMPTS, params)
        described = llm.info()["speculative"]
    assert described["synthetic"] is True and described["accepted_per_round"] == accepted
    for o in outs:
        ref = reference[tuple(o.prompt_token_ids)]
        assert o.token_ids == ref.token_ids
        assert [max(d.values()) for d in o.logprobs] == pytest.approx([max(d.values()) for d in ref.logprobs],
                                                                       abs=1e-4)
        s = o.spec
        assert s.num_drafts > 0
        # every round drafts min(k, budget) >= 1 tokens and accepts exactly min(accepted, drafted) of them
        assert all(n == 0 for n in s.accepted_per_position[accepted:])
        if accepted == 0:
            assert s.num_accepted_tokens == 0
        else:
            assert s.accepted_per_position[0] == s.num_drafts
        if accepted == 4:
            assert s.num_accepted_tokens == s.num_draft_tokens


class _ScriptedGate(SpeculationGate):
    """Says no to drafting on every other step and keeps what the engine reports."""

    def __init__(self):
        super().__init__(enabled=True)
        self.asked, self.records = 0, []

    def wants_drafts(self, batch: int) -> bool:
        self.asked += 1
        return self.asked % 2 == 1

    def record(self, batch, drafted, seconds, tokens_per_seq):
        self.records.append((batch, drafted, seconds, tokens_per_seq))


def test_the_engine_reports_each_decode_step_to_the_gate_and_plain_steps_keep_the_tokens(engine):
    llm, params, reference = engine
    gate = _ScriptedGate()
    with llm.proposer_swapped(_synthetic(llm, reference, accepted=3), gate):
        outs = llm.generate(PROMPTS, params)
    assert [o.token_ids for o in outs] == [reference[tuple(o.prompt_token_ids)].token_ids for o in outs]
    drafted = [r for r in gate.records if r[1]]
    plain = [r for r in gate.records if not r[1]]
    assert drafted and plain
    assert all(r[2] > 0 for r in gate.records)
    assert all(r[3] == 1.0 for r in plain)  # a plain step moves one token a sequence
    assert max(r[3] for r in drafted) == 4.0  # 3 accepted drafts + the target's token
    assert {r[0] for r in gate.records} <= {1, 2, 3}


@pytest.mark.parametrize("filters", [dict(top_k=40), {}], ids=["top-k", "whole-vocabulary"])
def test_a_seeded_sampled_requests_tokens_do_not_depend_on_the_gate(engine, filters):
    """Sampled requests are gated as greedy ones are: their draws are keyed by seed and position, so the steps the
    gate left plain and the rounds it let draft give target-only's tokens."""
    from onecat.engine import SamplingParams

    llm, _, reference = engine
    sampled = SamplingParams(temperature=0.8, seed=5, max_tokens=24, **filters)
    plain = llm.generate(PROMPTS, sampled)
    gate = _ScriptedGate()
    with llm.proposer_swapped(_synthetic(llm, reference, accepted=3), gate):
        gated = llm.generate(PROMPTS, sampled)
    assert gate.asked > 0 and any(r[1] for r in gate.records) and any(not r[1] for r in gate.records)
    assert sum(o.spec.num_accepted_tokens for o in gated) > 0
    assert [o.token_ids for o in gated] == [o.token_ids for o in plain]


def test_a_fractional_acceptance_is_spread_over_each_sequences_rounds(engine):
    llm, params, reference = engine
    with llm.proposer_swapped(_synthetic(llm, reference, accepted=1.5, k=3)):
        outs = llm.generate(PROMPTS, params)
    for o in outs:
        assert o.token_ids == reference[tuple(o.prompt_token_ids)].token_ids
        # rounds alternate 1, 2, 1, 2 ... accepted drafts (fewer only where the budget cut the draft)
        assert abs(o.spec.num_accepted_tokens - 1.5 * o.spec.num_drafts) <= 2
        assert o.spec.accepted_per_position[2] == 0


def test_probes_of_a_verdict_that_holds_are_spaced_out_and_a_change_is_still_seen():
    gate = SpeculationGate(probe_every=16)
    decisions = _feed(gate, 1, 2000, plain_s=1.0, round_s=1.2, tokens=2.0)
    assert len(decisions) - sum(decisions[100:]) - 100 <= 12  # 16, 32, ... 256 steps apart: few plain probes
    assert gate.report()["per_batch_size_up_to"][1]["probe_every"] == 256
    _feed(gate, 1, 3000, plain_s=1.0, round_s=3.0, tokens=1.1)  # acceptance collapses: drafting now loses
    assert gate.pays(1) is False


def test_an_unlucky_start_does_not_lock_drafting_out():
    """The first rounds are slow and accept little (warm-up, no drafter context yet); later ones win: the
    gate turns drafting back on within a few probes."""
    gate = SpeculationGate(probe_every=16)
    _feed(gate, 1, 12, plain_s=1.0, round_s=3.0, tokens=1.0)
    assert gate.pays(1) is False
    later = _feed(gate, 1, 200, plain_s=1.0, round_s=1.1, tokens=2.5)
    assert gate.pays(1) is True and sum(later[100:]) >= 95


def test_rounds_that_lose_badly_are_probed_only_as_often_as_the_probe_budget_allows():
    """A probe round that loses ~4.4 plain steps (round 5.7 steps moving 1.34 tokens) is spaced out until its
    probes cost about PROBE_COST of the decode time; one near break-even keeps being probed often."""
    gate = SpeculationGate(probe_every=32)
    decisions = _feed(gate, 1, 6000, plain_s=1.0, round_s=5.7, tokens=1.34)
    assert gate.pays(1) is False
    spacing = gate.report()["per_batch_size_up_to"][1]["probe_every"]
    assert spacing == math.ceil((5.7 - 1.34) / PROBE_COST) > MAX_PROBE_EVERY  # 436 steps: not held at 256
    probes = sum(decisions[3000:])
    assert 0 < probes <= 3000 // spacing + 1
    lost = probes * (5.7 - 1.34) / 3000  # time the probes cost over plain steps moving the same tokens
    assert lost < 1.5 * PROBE_COST
    worse = SpeculationGate(probe_every=32)
    _feed(worse, 1, 8000, plain_s=1.0, round_s=40.0, tokens=1.0)  # the budget alone would probe 1 in 3900
    assert worse.report()["per_batch_size_up_to"][1]["probe_every"] == MAX_LOSING_PROBE_EVERY
    near = SpeculationGate(probe_every=32)
    _feed(near, 1, 4000, plain_s=1.0, round_s=1.1, tokens=1.05)  # loses 0.05 steps a probe
    assert near.pays(1) is False and near.report()["per_batch_size_up_to"][1]["probe_every"] == 32


def test_a_step_that_captured_a_graph_is_counted_but_not_timed():
    """A drafter graph captured inside a step costs once, not every round: that step moves no average (a probe
    round that captured would otherwise keep drafting off long after), yet it counts toward the probe spacing."""
    gate = SpeculationGate(probe_every=8)
    _feed(gate, 1, 60, plain_s=1.0, round_s=0.5, tokens=2.0)
    before = gate.report()["per_batch_size_up_to"][1]
    assert gate.wants_drafts(1) and before["drafting_pays"]
    gate.record(1, True, None, 2.0)  # a round that captured a graph: 1000x its cost would flip the verdict
    gate.record(1, True, None, 2.0)
    after = gate.report()
    assert after["per_batch_size_up_to"][1]["round_ms"] == before["round_ms"]
    assert after["steps"]["untimed"] == 2 and after["per_batch_size_up_to"][1]["drafting_pays"]
    gate.record(1, True, 1000.0, 2.0)
    assert gate.pays(1) is False  # the same step timed would have turned drafting off


def test_the_decoder_leaves_untimed_the_steps_in_which_its_drafter_captured_graphs():
    from types import SimpleNamespace

    from onecat.engine.speculative.base import Proposer, SpeculativeDecoder

    class Capturing(Proposer):
        graphs = SimpleNamespace(captures=4)  # captured at start-up: not a step's

        def propose(self, seqs, budgets):
            return [[] for _ in seqs]

    proposer = Capturing(3)
    decoder = SpeculativeDecoder(proposer, 64, SpeculationGate())
    decoder.step_done(1, True, 0.5, 2.0)
    proposer.graphs.captures += 1  # a new bucket captured during the next step
    decoder.step_done(1, True, 0.5, 2.0)
    decoder.step_done(1, True, 0.5, 2.0)
    assert decoder.gate.report()["steps"]["untimed"] == 1 and decoder.gate.steps["drafted"] == 3


def _decoder(proposer, enabled: bool = True):
    from onecat.engine.speculative.base import SpeculativeDecoder

    return SpeculativeDecoder(proposer, 4096, SpeculationGate(enabled=enabled, probe_every=8))


def _seqs(token_lists):
    from onecat.engine import SamplingParams
    from onecat.engine.core.sequence import Sequence

    return [Sequence(f"r{i}", None, ids, SamplingParams(temperature=0.0, max_tokens=64), 0)
            for i, ids in enumerate(token_lists)]


def test_a_host_lookup_in_flight_keeps_the_pipeline_running_until_a_draft_is_found():
    """The decode pipeline asks a prompt-lookup proposer while a step is in flight (pipeline_paused): text that
    never repeats backs it off without draining the pipeline; a repeat drains it for a round; a step with nothing
    in flight, a gate that is off and a proposer that does not look up on the host are never asked there."""
    from onecat.engine.speculative.ngram import NgramProposer

    fresh = _seqs([list(range(100, 140)), list(range(200, 233))])  # no suffix occurs earlier
    decoder = _decoder(NgramProposer(3, prompt_lookup_min=2))
    assert not decoder.pipeline_paused(fresh)  # nothing in flight: the plain step asks with every token
    paused = []
    for _ in range(40):
        paused.append(decoder.pipeline_paused(fresh, in_flight=True))
        decoder.step_done(2, False, 1.0, 1.0)
    assert all(paused)  # each turn of the proposer was taken in flight: the pipeline never drained
    asked = decoder.pipelined_lookups
    assert 4 <= asked <= 10  # backed off 1, 2, 4, 8, 8, ... steps (probe_every = 8) as empty proposals are
    assert decoder.gate.report()["steps"]["proposer_skipped"] == 40 - asked
    assert decoder.describe()["pipelined_lookups"] == asked

    while decoder.gate.paused(2):  # to the proposer's next turn
        decoder.step_done(2, False, 1.0, 1.0)
    repeats = _seqs([list(range(100, 140)) + [100, 101], list(range(200, 233))])
    assert not decoder.pipeline_paused(repeats, in_flight=True)  # "100 101" occurred: drain, draft with every token
    assert decoder.pipelined_lookups == asked

    off = _decoder(NgramProposer(3, prompt_lookup_min=2), enabled=False)
    assert not off.pipeline_paused(fresh, in_flight=True) and off.pipelined_lookups == 0

    class OnDevice(NgramProposer):
        looks_up_on_host = False

    other = _decoder(OnDevice(3, prompt_lookup_min=2))
    assert not other.pipeline_paused(fresh, in_flight=True) and other.pipelined_lookups == 0


def test_a_step_where_some_still_prefill_follows_the_whole_batch_verdict():
    """Two of eight sequences decode while six still prefill: such mixed steps are never timed, so the verdict is
    the whole batch's (losing here: no drafts), not that of a bucket of two that would never be measured."""
    from onecat.engine.speculative.ngram import NgramProposer

    decoder = _decoder(NgramProposer(3, prompt_lookup_min=2))
    _feed(decoder.gate, 8, 64, plain_s=1.0, round_s=4.0, tokens=2.0)
    assert decoder.gate.pays(8) is False and decoder.gate.pays(2) is None
    seqs = _seqs([[5, 6, 7, 8] * 6] * 8)  # repeats: n-gram lookup always finds a draft
    for i, seq in enumerate(seqs):
        seq.num_computed_tokens = seq.num_tokens - (1 if i < 2 else 10)  # six with prompt left to compute
    assert decoder.lookahead(seqs) == {}
    decoder.gate = SpeculationGate(probe_every=8)  # a batch whose verdict is not known yet measures rounds first
    assert decoder.lookahead(seqs) != {}


def test_a_loss_confirmed_twice_is_spaced_out_at_once_not_by_doubling():
    """Rounds that cost ~14 plain steps and move 2.5 tokens (the embedded target on an H100 at batch 8): after the
    learning rounds and two confirming probes (32 and 64 steps apart) the next probe waits the budget's spacing;
    doubling there (128, 256, 512 ...) spent several percent of the decode time on probes."""
    gate = SpeculationGate(probe_every=32)
    decisions = _feed(gate, 8, 2000, plain_s=1.0, round_s=14.0, tokens=2.5)
    assert gate.pays(8) is False
    drafted = [i for i, d in enumerate(decisions) if d]
    learning = drafted[:WARMUP + 1]
    probes = drafted[WARMUP + 1:]
    assert learning == list(range(WARMUP + 1))
    assert [b - a for a, b in zip(probes, probes[1:])][:1] == [65]  # 32 then 64 plain steps, then the budget's
    assert len(probes) == 3 and probes[2] - probes[1] > MAX_LOSING_PROBE_EVERY
    assert gate.report()["per_batch_size_up_to"][8]["probe_every"] == MAX_LOSING_PROBE_EVERY
