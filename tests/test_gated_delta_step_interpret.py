"""The fused decode and verify steps of a Gated DeltaNet layer (engine/kernels/triton_gated_delta_step.py) under
Triton's interpreter on the CPU (the verify step both ways: triton_gated_delta_verify.py's three kernels and the
step kernel walking the rows), against the layer's torch path on the same inputs and cache: out_proj's input,
the convolution inputs and delta-rule states left in the rows' slots (other slots and layers untouched) and a
verify step's trail buffers (also buffers wider than the rows: a narrower verify graph's); the same bits with
in_proj's b|a columns handed over apart (a projection stored in two parts); and, in float16, a fused verify row's own tokens against fused decode steps of them.
Grouped and ungrouped key heads, widths that are not powers of two, padded verify rows. In float16 the interpreter
rounds as IEEE does, and out_proj's input is the torch path's bit for bit; in float32 it is close to its last
bits (the taps and transcendentals summed or evaluated in another order); in bfloat16 the interpreter truncates
where a GPU rounds to nearest, so only closeness is checked there."""
from __future__ import annotations

import pytest

from tests.triton_interpret import run_interpreted

COMMON = r"""
import torch
torch.set_grad_enabled(False)
from onecat.engine.cache.recurrent_state import RecurrentStateCache
from onecat.engine.config import ModelConfig
from onecat.engine.layers.gated_deltanet import GatedDeltaNet, delta_rows, linear_attention_sizes
from onecat.engine.quant.row_split import RowSplitLinear
from onecat.engine.random_models import shape_config

SLOTS = 6

def setup(dtype, **shape):
    torch.manual_seed(0)
    cfg = ModelConfig.from_hf(dict(shape_config("tiny-qwen3.5"), **shape))
    layer = GatedDeltaNet(cfg, state_index=1)
    for p in layer.parameters():
        p.data.normal_(0, 0.3)
    layer.A_log.data.uniform_(-2, 0)
    layer = layer.to(dtype)
    layer.use_fla = False
    s = linear_attention_sizes(cfg)
    caches = [RecurrentStateCache(2, SLOTS, s["conv_dim"], s["conv_kernel"], s["v_heads"], s["k_dim"], s["v_dim"],
                                  dtype, torch.device("cpu"), k_heads=s["k_heads"], recurrence=delta_rows)
              for _ in range(3)]  # the torch path's, the fused step's, the fused step's with the gates apart
    conv, ssm = torch.randn(caches[0].conv.shape).to(dtype), torch.randn(caches[0].ssm.shape) * 0.3
    for c in caches:
        c.conv.copy_(conv)
        c.ssm.copy_(ssm)
    return cfg, layer, caches

def torch_path(layer, x, plan):
    seen = []
    project = layer.out_proj.forward
    layer.out_proj.forward = lambda t: seen.append(t) or project(t)  # out_proj's input
    layer(x, plan)
    layer.out_proj.forward = project
    assert layer.path != "fused step"
    return seen[0]

class Columns(torch.nn.Module):
    # a part of a two-part in_proj: columns [start, start + out_features) of the whole one's output in a tensor of
    # their own (the same bits, so the fused step's outputs must match exactly)
    def __init__(self, whole, start, out_features):
        super().__init__()
        self.whole, self.start, self.out_features, self.in_features = [whole], start, out_features, whole.in_features

    def forward(self, x):
        return self.whole[0](x)[:, self.start:self.start + self.out_features].clone()

def fused(layer, x, plan, apart=False):
    if apart:  # in_proj stored in two parts (q|k|v|z, b|a) as a packed checkpoint keeps it: the layer reads them apart
        whole, split = layer.in_proj, layer.in_proj.out_features - 2 * layer.v_heads
        layer.in_proj = RowSplitLinear([Columns(whole, 0, split), Columns(whole, split, 2 * layer.v_heads)])
        projected, gates = layer._project_apart(x)
        layer.in_proj = whole
        assert gates is not None and projected.shape[1] == split
        out = layer.fused_step(projected, plan, gates=gates)
    else:
        out = layer.fused_step(layer.in_proj(x), plan)
    assert layer.path == "fused step"
    return out

def agree(got, want, tol, exact, what):
    if exact:
        assert torch.equal(got, want), (what, float((got.float() - want.float()).abs().max()))
    err = (got.float() - want.float()).abs().max() / want.float().abs().max().clamp(min=1e-30)
    assert err < tol, (what, float(err))

def same_apart(layer, x, caches, plan, got):
    assert torch.equal(fused(layer, x, plan, apart=True), got)
    assert torch.equal(caches[2].conv, caches[1].conv) and torch.equal(caches[2].ssm, caches[1].ssm)
    if plan.rows is not None:
        for name in ("pre_ssm", "conv", "k", "v", "g", "beta"):
            assert torch.equal(getattr(caches[2].verify_trails, name), getattr(caches[1].verify_trails, name)), name

def untouched(cache, before, rows):
    others = [i for i in range(SLOTS + 1) if i not in rows]
    for now, was in zip((cache.conv, cache.ssm), before):
        assert torch.equal(now[:, others], was[:, others]) and torch.equal(now[0], was[0])
"""

DECODE = COMMON + r"""
def check(dtype, tol, exact, **shape):
    cfg, layer, caches = setup(dtype, **shape)
    before = (caches[1].conv.clone(), caches[1].ssm.clone())
    rows = torch.tensor([3, 0, 5])
    x = torch.randn(len(rows), cfg.hidden_size).to(dtype)
    want = torch_path(layer, x, caches[0].decode_plan(rows))
    got = fused(layer, x, caches[1].decode_plan(rows))
    agree(got, want, tol, exact, (dtype, shape, "output"))
    same_apart(layer, x, caches, caches[2].decode_plan(rows), got)
    assert torch.equal(caches[1].conv, caches[0].conv)  # the inputs are moved, never computed
    agree(caches[1].ssm, caches[0].ssm, tol, False, (dtype, shape, "state"))
    untouched(caches[1], before, rows.tolist())

check(torch.float32, 1e-5, False, linear_num_key_heads=4, linear_key_head_dim=8)
check(torch.float16, 1e-5, True)
check(torch.float16, 1e-5, True, linear_num_value_heads=6, linear_value_head_dim=12, linear_conv_kernel_dim=3)
check(torch.bfloat16, 5e-2, False)
print("ok")
"""

VERIFY = COMMON + r"""
WIDTH = 5

def check(dtype, tol, exact, trail_width=WIDTH, **shape):
    cfg, layer, caches = setup(dtype, **shape)
    for c in caches:  # trail buffers wider than the rows (a narrower verify graph's rows on buffers made for 1 + k)
        c.reserve_verify(trail_width)
    before = (caches[1].conv.clone(), caches[1].ssm.clone())
    slots, own = [4, 1, 2], [WIDTH, 2, 1]  # a full row and padded ones
    rows, lead = torch.tensor(slots), torch.tensor([WIDTH - m for m in own])
    x = torch.randn(len(slots) * WIDTH, cfg.hidden_size).to(dtype)
    start = [(c.conv[:, slots].clone(), c.ssm[:, slots].clone()) for c in caches][0]
    want = torch_path(layer, x, caches[0].verify_plan(rows, lead, WIDTH))
    got = fused(layer, x, caches[1].verify_plan(rows, lead, WIDTH))
    if not exact:  # the gates' addressing, once (float32)
        same_apart(layer, x, caches, caches[2].verify_plan(rows, lead, WIDTH), got)
    mine = torch.cat([torch.arange(i * WIDTH + WIDTH - m, (i + 1) * WIDTH) for i, m in enumerate(own)])
    agree(got[mine], want[mine], tol, exact, (dtype, shape, "own tokens' outputs"))
    assert torch.equal(caches[1].conv, caches[0].conv), (dtype, shape, "carried-over inputs")
    agree(caches[1].ssm, caches[0].ssm, tol, False, (dtype, shape, "state"))
    untouched(caches[1], before, slots)
    t0, t1 = caches[0].verify_trails, caches[1].verify_trails
    assert torch.equal(t1.pre_ssm[1, slots], start[1][1]) and torch.equal(t1.conv[1, slots], t0.conv[1, slots])
    for name in ("k", "v", "g", "beta"):  # g: softplus's log1p evaluated in another way
        agree(getattr(t1, name)[1, slots], getattr(t0, name)[1, slots], tol, exact and name != "g",
              (dtype, shape, name))

    if not exact:
        return
    # the same own tokens through fused decode steps, one after another from the same start (caches[2], not yet
    # stepped in float16): the same bits, where the CPU's float16 GEMM gives a row the same bits alone as among
    # others (the layer's projections run on it before any kernel under test: on CPUs with AVX512-FP16 it picks
    # its kernel by the row count, and there the steps are held to the tolerance instead)
    rows_exact = all(torch.equal(layer.in_proj(x[r:r + 1]), layer.in_proj(x)[r:r + 1]) for r in range(len(x)))
    for i, (slot, m) in enumerate(zip(slots, own)):
        for j in range(m):
            step = fused(layer, x[i * WIDTH + WIDTH - m + j][None], caches[2].decode_plan(torch.tensor([slot])))
            agree(step[0], got[i * WIDTH + WIDTH - m + j], tol, rows_exact, (dtype, shape, slot, j))
        agree(caches[2].ssm[1, slot], caches[1].ssm[1, slot], tol, rows_exact, (dtype, shape, slot, "state"))
        agree(caches[2].conv[1, slot], caches[1].conv[1, slot], tol, rows_exact, (dtype, shape, slot, "inputs"))

check(torch.float32, 1e-5, False, linear_num_value_heads=6, linear_value_head_dim=12, linear_conv_kernel_dim=3)
check(torch.float16, 1e-5, True, trail_width=WIDTH + 3, linear_num_key_heads=4, linear_key_head_dim=8)
print("ok")
"""


def test_fused_decode_step_matches_the_torch_path_under_the_interpreter():
    pytest.importorskip("triton")
    run_interpreted(DECODE, timeout=600)


SPLIT = r"""
from onecat.engine.kernels import triton_gated_delta_verify as verify_kernels
verify_kernels.SPLIT_VERIFY = {split}
calls, split_step = [], verify_kernels.fused_step
verify_kernels.fused_step = lambda *a, **k: calls.append(1) or split_step(*a, **k)
"""


@pytest.mark.parametrize("split", [True, pytest.param(False, marks=pytest.mark.slow)],
                         ids=["split kernels", "step kernel"])
def test_fused_verify_rows_match_the_torch_path_and_fused_decode_steps_under_the_interpreter(split):
    """Both verify paths: the three kernels of triton_gated_delta_verify.py (the default) and `step` walking the
    rows (ONECAT_GDN_SPLIT_VERIFY=0, the A/B alternative: ~60 s on two cores, marked slow); each must be the one
    that ran."""
    pytest.importorskip("triton")
    script = VERIFY.replace('print("ok")', f"assert bool(calls) == {split}, calls\nprint(\"ok\")")
    run_interpreted(SPLIT.format(split=split) + script, timeout=600)
