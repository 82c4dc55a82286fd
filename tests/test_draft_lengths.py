"""Per-request draft lengths (engine/speculative/draft_length.py) and the verify widths they replay
(engine/worker/cuda_graph.py `verify_widths`, checked on the host without a GPU)."""
from __future__ import annotations

from types import SimpleNamespace

from onecat.engine.speculative import draft_length
from onecat.engine.speculative.draft_length import DraftLengths, RoundCosts
from onecat.engine.worker.cuda_graph import NARROW_VERIFY_MAX_SIZE, DecodeGraphs


def _rounds(lengths: DraftLengths, rid: str, n: int, accepted: int) -> list[int]:
    """n rounds in which the first `accepted` drafts (at most the length asked) are accepted: the lengths asked."""
    asked = []
    for _ in range(n):
        k = lengths.length(rid)
        asked.append(k)
        lengths.observe(rid, k, min(accepted, k))
    return asked


def test_a_new_request_drafts_the_block_and_stops_offering_what_is_never_accepted():
    lengths = DraftLengths(15)
    asked = _rounds(lengths, "a", 30, accepted=3)
    assert asked[0] == 15
    assert asked[-10:] == [4] * 10  # the three accepted positions and one more, still tried
    assert lengths.describe()["drafts_asked_per_block"] < 0.6


def test_a_rise_in_acceptance_is_followed_back_to_the_whole_block():
    lengths = DraftLengths(15)
    _rounds(lengths, "a", 30, accepted=1)
    assert lengths.length("a") == 2
    asked = _rounds(lengths, "a", 60, accepted=15)
    assert asked[-1] == 15 and asked == sorted(asked)  # one more position each time the last one was taken
    assert sum(1 for a in asked if a < 15) <= 20


def test_a_new_request_starts_where_the_finished_ones_ended():
    """Not five rounds of whole blocks each: the pooled rates of the finished requests, which its own rounds then
    overrule either way."""
    lengths = DraftLengths(15)
    assert _rounds(lengths, "a", 30, accepted=3)[:6] == [15] * 5 + [4]  # nothing pooled yet
    lengths.release("a")
    assert _rounds(lengths, "b", 3, accepted=3) == [4, 4, 4]
    better = _rounds(lengths, "c", 6, accepted=15)  # a request whose drafts are all taken: its own rounds win
    assert better[0] == 4 and better[1] > 4 and better[-1] == 15
    worse = _rounds(lengths, "d", 12, accepted=0)  # b and c not finished: d starts from a's ending too
    assert worse[0] == 4 and worse[-1] == 1
    lengths.release("d")
    assert lengths.length("d") <= 4  # a's and d's endings pooled
    lengths.release("never-drafted")  # a request that made no round adds nothing
    assert lengths.length("e") == lengths.length("d")


def test_a_released_request_starts_from_the_pool_not_its_old_counts():
    lengths = DraftLengths(7)
    _rounds(lengths, "a", 20, accepted=0)
    assert lengths.length("a") == 1
    lengths.release("a")
    _rounds(lengths, "b", 20, accepted=7)
    for _ in range(4):  # finished requests that took every draft
        lengths.release("b")
        _rounds(lengths, "b", 20, accepted=7)
    assert lengths.length("a") == 7
    assert DraftLengths(7).length("x") == 7  # nothing pooled yet: the whole block


def test_the_pool_can_be_switched_off_for_an_a_b(monkeypatch):
    from onecat.engine.speculative import draft_length

    monkeypatch.setattr(draft_length, "POOL", False)
    lengths = DraftLengths(15)
    _rounds(lengths, "a", 30, accepted=3)
    lengths.release("a")
    assert lengths.length("b") == 15  # the prior alone, as before the pool


def _timed_rounds(lengths: DraftLengths, rid: str, n: int, accepted: int, cost) -> list[int]:
    """As _rounds, each round then timed as the engine times it: `cost(drafts)` seconds at batch 1."""
    asked = []
    for _ in range(n):
        k = lengths.length(rid, 1)
        asked.append(k)
        lengths.observe(rid, k, min(accepted, k))
        lengths.costs.record(1, k, cost(k))
    return asked


def test_round_costs_are_medians_of_recent_timings_and_optimistic_where_untimed():
    costs = RoundCosts()
    for _ in range(3):
        costs.record(1, 0, 10.0)  # plain steps alone say nothing of a round's cost
    assert not costs.known(1)
    costs.record(1, 7, 90.0)  # a request's first round (its prompt's features projected): far dearer
    costs.record(1, 7, 20.0)
    assert not costs.known(1)  # two timings: not yet a price
    costs.record(1, 7, 21.0)
    assert costs.known(1) and not costs.known(2)
    est = costs.estimates(1, 9)
    assert est[6] == 21.0  # the median: the outlier does not set the price
    assert est[2] == 10.0 + 11.0 * 3 / 7  # between the plain step and the timed length
    assert est[8] == 21.0  # wider than any timed: no dearer than the widest
    for _ in range(3):
        costs.record(1, 8, 20.5)  # timed a little below a narrower length (a busy machine's noise)
    assert costs.estimates(1, 8)[7] == 21.0  # never below a narrower length's price
    only_rounds = RoundCosts()
    for t in (16.0, 16.0, 16.0):
        only_rounds.record(4, 7, t)
    assert only_rounds.estimates(3, 3)[2] == 16.0 * 4 / 8  # narrower, nothing below: in proportion to its rows
    assert only_rounds.describe() == {"4": {"7": 16000.0}}  # milliseconds
    for _ in range(draft_length.MAX_AGE):
        only_rounds.record(4, 2, 5.0)
    assert 7 not in only_rounds._timed(4)  # not re-timed for MAX_AGE steps: untimed again, so tried again


def test_timed_rounds_set_the_length_where_a_wider_round_costs_more_than_its_drafts_bring():
    """Three drafts always accepted. Rows that cost a jump past four drafts (as the CPU's second row block does):
    three drafts, not the rate-only rule's three and one more. Rows that cost nothing: the whole block, since every
    position's estimated rate is above zero."""
    def jump(n):
        return 1.0 + 0.01 * n + (0.3 if n > 4 else 0.0)

    asked = _timed_rounds(DraftLengths(7, costed=True), "a", 40, accepted=3, cost=jump)
    assert asked[0] == 7 and asked[-20:] == [3] * 20
    assert asked.count(7) <= 4  # the rate-only rule's first rounds, then three to price the length
    assert _rounds(DraftLengths(7), "a", 40, accepted=3)[-1] == 4  # untimed: the rate-only rule
    flat = _timed_rounds(DraftLengths(7, costed=True), "b", 40, accepted=3, cost=lambda n: 1.0)
    assert flat[-1] == 7
    rising = DraftLengths(7, costed=True)  # positions no longer offered drift back to the prior: tried again
    asked = _timed_rounds(rising, "c", 40, accepted=3, cost=jump)
    asked += _timed_rounds(rising, "c", 80, accepted=7, cost=jump)
    assert asked[-1] == 7
    assert "round_ms_by_batch_and_drafts" in rising.describe()


def test_timed_costs_are_off_by_default_and_the_switch_turns_them_on(monkeypatch):
    asked = _timed_rounds(DraftLengths(7), "a", 40, accepted=3, cost=lambda n: 1.0 + (0.3 if n > 4 else 0.0))
    assert asked[-1] == 4  # the rate-only rule: three accepted positions and one more
    monkeypatch.setattr(draft_length, "COSTED", True)
    assert DraftLengths(7).costed


def _graphs(hybrid: bool = False) -> DecodeGraphs:
    primary = SimpleNamespace(name="fake", graph_safe=True, graph_safe_verify=True)
    model = SimpleNamespace(states=object() if hybrid else None)
    return DecodeGraphs(model, None, SimpleNamespace(primary=primary), 16, "cpu", 256, 4)


def _sched(drafts: list[int]):
    seq = SimpleNamespace(num_computed_tokens=9, num_tokens=10, prompt_logprobs=None, num_prompt_tokens=5)
    return [SimpleNamespace(num_lookahead=d, num_new_tokens=1, seq=seq) for d in drafts]


def test_a_verify_step_replays_the_narrowest_width_its_longest_draft_fits():
    graphs = _graphs()
    graphs.verify_query_len = 16
    assert graphs.verify_widths() == [16]  # a proposer whose drafts are not trimmed: one width, as captured
    graphs.narrow_verify = True
    assert graphs.verify_widths() == [2, 4, 8, 16]
    assert graphs.eligible(_sched([3, 1])) == (2, 4)
    assert graphs.eligible(_sched([4, 0, 2])) == (4, 8)
    assert graphs.eligible(_sched([15])) == (1, 16)
    assert graphs.eligible(_sched([0, 0])) == (2, 1)  # a plain decode step
    assert graphs.eligible(_sched([16])) is None  # wider than any captured width: eager
    graphs.verify_query_len = 6
    assert graphs.verify_widths() == [2, 4, 6]
    assert graphs.verify_widths(NARROW_VERIFY_MAX_SIZE + 1) == [6]  # large batches: the full width only


def test_a_hybrid_model_verifies_narrower_rows_on_its_one_set_of_trail_buffers(monkeypatch):
    """Narrower widths for a hybrid model too: its trail buffers are made once for the widest row before any
    verify graph (ModelRunner.setup_verify); a wider k later makes them again and drops the verify graphs captured
    on the old ones, keeping the decode graphs."""
    import torch

    from onecat.engine.cache.recurrent_state import RecurrentStateCache
    from onecat.engine.worker.model_runner import ModelRunner

    from onecat.engine.worker import cuda_graph

    graphs = _graphs(hybrid=True)
    graphs.verify_query_len, graphs.narrow_verify = 8, True
    monkeypatch.setattr(cuda_graph, "HYBRID_NARROW_VERIFY", False)
    assert graphs.verify_widths() == [8]  # ONECAT_HYBRID_NARROW_VERIFY off: the one width
    monkeypatch.setattr(cuda_graph, "HYBRID_NARROW_VERIFY", True)
    assert graphs.verify_widths() == [2, 4, 8] and graphs.eligible(_sched([1])) == (1, 2)
    states = RecurrentStateCache(2, 3, conv_dim=8, conv_kernel=4, heads=2, k_dim=4, v_dim=4,
                                 dtype=torch.float32, device=torch.device("cpu"))
    runner = SimpleNamespace(model=SimpleNamespace(states=states), graphs=graphs)
    ModelRunner.setup_verify(runner, 8, False, narrow=True)
    trails = states.verify_trails
    assert trails.width == 8
    graphs.graphs = {(1, 1, ()): "decode", (1, 2, ()): "verify 2", (1, 8, ()): "verify 8"}
    assert states.reserve_verify(2) is trails and states.reserve_verify(8) is trails  # narrower rows: the same
    ModelRunner.setup_verify(runner, 8, False, narrow=True)
    assert len(graphs.graphs) == 3  # the same k: the buffers and the graphs stay
    ModelRunner.setup_verify(runner, 16, False, narrow=True)
    assert states.verify_trails.width == 16 and states.verify_trails is not trails
    assert list(graphs.graphs) == [(1, 1, ())] and graphs.report()["captured_verify_widths"] == []


def test_the_decoder_times_rounds_by_their_widest_draft_only_where_lengths_are_priced(monkeypatch):
    from onecat.engine import SamplingParams
    from onecat.engine.core.sequence import Sequence
    from onecat.engine.speculative.base import Proposer, SpeculativeDecoder
    from onecat.engine.speculative.controller import SpeculationGate

    class Fixed(Proposer):
        trims_drafts = True

        def propose(self, seqs, budgets):
            return [[1] * min(b, 2 + i) for i, b in enumerate(budgets)]  # 2 and 3 drafts

    def decoder():
        return SpeculativeDecoder(Fixed(5), 4096, SpeculationGate(enabled=False))

    seqs = [Sequence(f"r{i}", None, list(range(10, 30)), SamplingParams(temperature=0.0, max_tokens=64), 0)
            for i in range(2)]
    for s in seqs:
        s.num_computed_tokens = s.num_tokens - 1
    plain = decoder()
    plain.lookahead(seqs)
    plain.step_done(2, True, 0.5, 2.0)
    assert not plain.lengths.costed and plain.lengths.describe()["round_ms_by_batch_and_drafts"] == {}
    monkeypatch.setattr(draft_length, "COSTED", True)
    priced = decoder()
    assert priced.lookahead(seqs) == {"r0": 2, "r1": 3}
    priced.step_done(2, True, 0.5, 2.0)
    priced.step_done(2, False, 0.25, 1.0)  # a plain step: 0 drafts
    assert priced.lengths.describe()["round_ms_by_batch_and_drafts"] == {"2": {"0": 250.0, "3": 500.0}}
