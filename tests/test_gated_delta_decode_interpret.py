"""The fused one-token decode step of a Gated DeltaNet layer (engine/kernels/triton_gated_delta_decode.py) under
Triton's interpreter on the CPU, against the layer's torch path on the same inputs and cache: the layer's
output, and the convolution inputs and delta-rule states left in the rows' slots (other slots untouched), for
grouped and ungrouped key heads, widths that are not powers of two. In float16 out_proj's input is
the torch path's bit for bit here (the interpreter rounds as IEEE does), in float32 close to its last bits (the taps and transcendentals summed or
evaluated in another order); in bfloat16 the interpreter truncates
where a GPU rounds to nearest, so only closeness is checked."""
from __future__ import annotations

import pytest

from tests.triton_interpret import run_interpreted

SCRIPT = r"""
import torch
torch.set_grad_enabled(False)
from onecat.engine.cache.recurrent_state import RecurrentStateCache
from onecat.engine.config import ModelConfig
from onecat.engine.layers.gated_deltanet import GatedDeltaNet, delta_rows, linear_attention_sizes
from onecat.engine.random_models import shape_config

def check(dtype, tol, exact, **shape):
    torch.manual_seed(0)
    raw = dict(shape_config("tiny-qwen3.5"), **shape)
    cfg = ModelConfig.from_hf(raw)
    layer = GatedDeltaNet(cfg, state_index=1)
    for p in layer.parameters():
        p.data.normal_(0, 0.3)
    layer.A_log.data.uniform_(-2, 0)
    layer = layer.to(dtype)
    s = linear_attention_sizes(cfg)
    slots = 6
    caches = [RecurrentStateCache(2, slots, s["conv_dim"], s["conv_kernel"], s["v_heads"], s["k_dim"], s["v_dim"],
                                  dtype, torch.device("cpu"), k_heads=s["k_heads"], recurrence=delta_rows)
              for _ in range(2)]
    conv = torch.randn(caches[0].conv.shape).to(dtype)
    ssm = torch.randn(caches[0].ssm.shape) * 0.3
    for c in caches:
        c.conv.copy_(conv)
        c.ssm.copy_(ssm)
    rows = torch.tensor([3, 0, 5])
    x = torch.randn(len(rows), cfg.hidden_size).to(dtype)
    layer.use_fla = False
    seen = []
    project = layer.out_proj.forward
    layer.out_proj.forward = lambda t: seen.append(t) or project(t)  # out_proj's input
    layer(x, caches[0].decode_plan(rows))
    assert layer.path == "torch"
    got = layer.fused_decode(layer.in_proj(x), caches[1].decode_plan(rows))
    assert layer.path == "fused decode"
    want = seen[0]
    if exact:
        assert torch.equal(got, want), (dtype, shape, float((got.float() - want.float()).abs().max()))
    err = (got.float() - want.float()).abs().max() / want.float().abs().max()
    assert err < tol, (dtype, shape, float(err))
    conv_err = (caches[1].conv.float() - caches[0].conv.float()).abs().max()
    assert conv_err == 0, (dtype, shape, float(conv_err))  # the inputs are moved, never computed
    ssm_err = (caches[1].ssm - caches[0].ssm).abs().max() / caches[0].ssm.abs().max()
    assert ssm_err < tol, (dtype, shape, float(ssm_err))
    untouched = [i for i in range(slots + 1) if i not in rows.tolist()]
    assert torch.equal(caches[1].conv[:, untouched], conv[:, untouched])
    assert torch.equal(caches[1].ssm[:, untouched], ssm[:, untouched])
    assert torch.equal(caches[1].ssm[0], ssm[0]) and torch.equal(caches[1].conv[0], conv[0])  # another layer's

check(torch.float32, 1e-5, False)
check(torch.float32, 1e-5, False, linear_num_value_heads=6, linear_value_head_dim=12, linear_conv_kernel_dim=3)
check(torch.float32, 1e-5, False, linear_num_key_heads=4, linear_key_head_dim=8)
check(torch.float16, 1e-5, True)
check(torch.float16, 1e-5, True, linear_num_value_heads=6, linear_value_head_dim=12, linear_conv_kernel_dim=3)
check(torch.bfloat16, 5e-2, False)
print("ok")
"""


def test_fused_decode_step_matches_the_torch_path_under_the_interpreter():
    pytest.importorskip("triton")
    run_interpreted(SCRIPT, timeout=600)
