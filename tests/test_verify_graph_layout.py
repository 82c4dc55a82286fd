"""The verify graph's row layout (engine/worker/cuda_graph.py), checked on the host buffers alone: a row
of d < k drafts is padded at its front, its own tokens keep their positions, KV slots and length, and the
padding writes only into the null block."""
from __future__ import annotations

import numpy as np
import pytest

from onecat.engine.worker.cuda_graph import GraphStep, fill_rows, real_rows, verify_lead

BS = 4


def _fill(step: GraphStep, width: int = 8):
    n, q = len(step.starts), step.q
    pos, slots = np.full(n * q, -1, dtype=np.int64), np.full(n * q, -1, dtype=np.int64)
    lens, tables = np.zeros(n, dtype=np.int64), np.zeros((n, width), dtype=np.int64)
    fill_rows(step, pos, slots, lens, tables, BS)
    return pos.reshape(n, q), slots.reshape(n, q), lens, tables


def test_rows_of_every_draft_length_keep_their_own_positions_slots_and_length():
    q = 5
    tables = [[7, 3, 9, 11], [2, 5], [4, 6, 8], [1]]
    starts = [9, 5, 10, 0]  # position of each row's last token
    drafts = [4, 2, 0, 1]
    step = GraphStep(size=4, q=q, ids=None, starts=starts, tables=tables, gemv_rows=1, drafts=drafts)
    pos, slots, lens, tab = _fill(step)
    for i, (p, d, table) in enumerate(zip(starts, drafts, tables)):
        lead = verify_lead(q, d)
        own = list(range(p, p + d + 1))
        assert pos[i, lead:].tolist() == own  # the row's token and its drafts, at the end of the row
        assert slots[i, lead:].tolist() == [table[t // BS] * BS + t % BS for t in own]
        assert lens[i] == p + d + 1  # the row's own length, as an eager step of d + 1 tokens has it
        # the graph gives token j the context lens - (q - 1) + j: exactly p + 1 + m for own token m
        assert [lens[i] - (q - 1) + j for j in range(lead, q)] == [p + 1 + m for m in range(d + 1)]
        assert all(0 <= s < BS for s in slots[i, :lead])  # padding writes only into the null block 0
        assert all(0 <= x <= p for x in pos[i, :lead])  # and sits at valid earlier positions
        assert tab[i, :len(table)].tolist() == table


def test_a_uniform_verify_step_is_unchanged_by_the_padding_rule():
    q = 3
    step = GraphStep(size=2, q=q, ids=None, starts=[6, 2], tables=[[1, 2, 5], [3, 4]], gemv_rows=1, drafts=[2, 2])
    pos, slots, lens, _ = _fill(step)
    assert pos.tolist() == [[6, 7, 8], [2, 3, 4]]
    assert lens.tolist() == [9, 5]
    assert real_rows(q, [2, 2]) == list(range(6))


def test_real_rows_pick_the_own_tokens_in_eager_order():
    assert real_rows(4, [3, 0, 1]) == [0, 1, 2, 3, 7, 10, 11]


def test_a_row_with_more_drafts_than_the_width_is_refused():
    with pytest.raises(ValueError, match="do not fit a verify row of 3 tokens"):
        verify_lead(3, 3)
