"""Verify rows of a Gated DeltaNet layer (engine/layers/gated_deltanet.py, engine/cache/recurrent_state.py), on the
CPU: a CUDA graph's verify step puts each request's own tokens (its token and drafts) behind padding in rows of
equal width. Each own token's output, and the state the row leaves in its slot, must be bit for bit what decode
steps of those tokens give; a rollback to any accepted prefix must recompute bit for bit the state after it.
The Triton kernel of the same rows (CUDA) is checked against the reference under Triton's interpreter."""
from __future__ import annotations

import pytest
import torch

from onecat.engine.cache.recurrent_state import RecurrentStateCache, Trail
from onecat.engine.config import ModelConfig
from onecat.engine.layers.gated_deltanet import GatedDeltaNet, delta_rows, linear_attention_sizes
from onecat.engine.random_models import shape_config
from tests.triton_interpret import run_interpreted

WIDTH = 5


def _layer_and_cache(slots: int = 4):
    torch.manual_seed(0)
    cfg = ModelConfig.from_hf(shape_config("tiny-qwen3.5"))
    layer = GatedDeltaNet(cfg, state_index=0).float()
    for p in layer.parameters():
        p.data.normal_(0, 0.3)
    layer.A_log.data.uniform_(-2, 0)  # decays in (0, 1), kept over several tokens
    s = linear_attention_sizes(cfg)
    cache = RecurrentStateCache(1, slots, s["conv_dim"], s["conv_kernel"], s["v_heads"], s["k_dim"], s["v_dim"],
                                torch.float32, torch.device("cpu"), k_heads=s["k_heads"], recurrence=delta_rows)
    return cfg, layer, cache


def _decode(layer, cache, slot: int, position: int, x: torch.Tensor) -> torch.Tensor:
    """One decode step of one request (position: tokens its state holds before this one)."""
    cache.prepare_decode([slot], [position + 1])
    return layer(x.unsqueeze(0), cache.decode_plan(torch.tensor([slot])))[0]


def _history(layer, cache, slots, lengths, hidden: int):
    """Give each slot a state after `lengths` decode steps of random inputs."""
    for slot, n in zip(slots, lengths):
        for p in range(n):
            _decode(layer, cache, slot, p, torch.randn(hidden))


def _snapshot(cache, slot):
    return cache.conv[:, slot].clone(), cache.ssm[:, slot].clone()


@torch.no_grad()  # as the engine runs its steps: with autograd recording, oneDNN's linear may take another kernel
def test_verify_rows_give_decode_steps_outputs_and_states_and_roll_back_exactly():
    cfg, layer, cache = _layer_and_cache()
    slots, history, own = [0, 1, 2], [3, 6, 1], [WIDTH, 2, 1]  # own tokens: full row, padded rows
    _history(layer, cache, slots, history, cfg.hidden_size)
    before = {s: _snapshot(cache, s) for s in slots}
    rows = [torch.randn(WIDTH, cfg.hidden_size) for _ in slots]  # padding tokens first, then the own tokens

    expected, after_each = {}, {}
    for slot, n, m, x in zip(slots, history, own, rows):  # decode steps of the own tokens, from the same state
        cache.conv[:, slot], cache.ssm[:, slot] = before[slot]
        cache.position[slot] = n
        outs, states = [], []
        for j in range(m):
            outs.append(_decode(layer, cache, slot, n + j, x[WIDTH - m + j]))
            states.append(_snapshot(cache, slot))
        expected[slot], after_each[slot] = torch.stack(outs), states
        cache.conv[:, slot], cache.ssm[:, slot] = before[slot]
        cache.position[slot] = n

    cache.prepare_verify(slots, [n + m for n, m in zip(history, own)], own, WIDTH)
    plan = cache.verify_plan(torch.tensor(slots), torch.tensor([WIDTH - m for m in own]), WIDTH)
    got = layer(torch.cat(rows), plan).view(len(slots), WIDTH, -1)
    for i, (slot, m) in enumerate(zip(slots, own)):
        assert torch.equal(got[i, WIDTH - m:], expected[slot]), slot
        conv, ssm = _snapshot(cache, slot)
        assert torch.equal(conv, after_each[slot][-1][0]) and torch.equal(ssm, after_each[slot][-1][1]), slot

    verified = {s: _snapshot(cache, s) for s in slots}
    for slot, n, m in zip(slots, history, own):
        for used in range(1, m + 1):  # the next step starts after `used` own tokens: rolled back (or kept)
            cache.conv[:, slot], cache.ssm[:, slot] = verified[slot]  # as the verify step left the slot
            cache.position[slot] = n + m
            cache.trails[slot] = Trail(n, WIDTH - m, m)
            rollbacks = cache.rollbacks
            cache.prepare_decode([slot], [n + used + 1])
            conv, ssm = _snapshot(cache, slot)
            assert torch.equal(conv, after_each[slot][used - 1][0]), (slot, used)
            assert torch.equal(ssm, after_each[slot][used - 1][1]), (slot, used)
            assert cache.rollbacks == rollbacks + (used < m)


def test_a_rollback_outside_the_last_verify_row_is_refused():
    cfg, layer, cache = _layer_and_cache()
    _history(layer, cache, [0], [4], cfg.hidden_size)
    cache.prepare_verify([0], [7], [3], WIDTH)
    with pytest.raises(RuntimeError, match="keeps none after 8"):
        cache.prepare_decode([0], [9])


KERNEL_SCRIPT = r"""
import torch
from onecat.engine.kernels import triton_gated_delta_rows as kernel
from onecat.engine.layers import gated_deltanet_ops as ops
torch.manual_seed(0)
rows, width, hk, hv, dk, dv, slots = 3, 5, 2, 4, 16, 8, 6
q, k = torch.randn(rows, width, hk, dk), torch.randn(rows, width, hk, dk)
v, g = torch.randn(rows, width, hv, dv), -torch.rand(rows, width, hv)
beta = torch.rand(rows, width, hv)
states = torch.randn(slots, hv, dk, dv) * 0.3
index, begin, end = torch.tensor([4, 0, 2]), torch.tensor([0, 3, 1]), torch.tensor([5, 5, 3])
out_states = states.clone()
out = kernel.rows_recurrence(q, k, v, g, beta, states, index, out_states, index, begin, end)
ref_out, ref_states = ops.rows_recurrence(q, k, v, g, beta, states[index], begin, end)
assert (out - ref_out).abs().max() < 1e-4, (out - ref_out).abs().max()
assert (out_states[index] - ref_states).abs().max() < 1e-4
untouched = [s for s in range(slots) if s not in index.tolist()]
assert torch.equal(out_states[untouched], states[untouched])
# width 5 ran padded to 8 (zeros past every row's end); into a caller's buffer it runs at its own width: same bits
assert out.shape == (rows, width, hv, dv)
given, given_states = torch.empty(rows, width, hv, dv), states.clone()
kernel.rows_recurrence(q, k, v, g, beta, states, index, given_states, index, begin, end, out=given)
assert torch.equal(given, out) and torch.equal(given_states, out_states)
print("ok")
"""


def test_triton_rows_kernel_matches_the_reference_under_the_interpreter():
    pytest.importorskip("triton")
    run_interpreted(KERNEL_SCRIPT, timeout=300)
