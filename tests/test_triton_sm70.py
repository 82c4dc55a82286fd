"""The offline sm_70 check of the Triton kernels (`onecat kernels check`): where Triton and the sm_70
toolchain are installed, every W4A16 / FP4 GEMV instantiation the engine launches on a V100 for the 8B
projections, the MoE decode GEMVs at the Qwen3-30B-A3B widths, the Gated DeltaNet kernels at the Qwen3.5-27B
widths, and the tensor-parallel peer all-reduce /
all-gather at TP=4, build for sm_70 without spills and with 128-bit loads."""
from __future__ import annotations

import pytest


def test_w4a16_gemv_builds_for_sm70_without_spills():
    from onecat.engine.kernel_tools.toolchain import ToolchainMissing, find_toolchain
    from onecat.engine.kernel_tools.triton_sm70 import CASES, run_triton_check, triton_unavailable_reason

    reason = triton_unavailable_reason()
    if reason:
        pytest.skip(reason)
    try:
        toolchain = find_toolchain()
    except ToolchainMissing as e:
        pytest.skip(str(e))
    reports = run_triton_check(toolchain)
    # W4A16, NVFP4, MXFP4; MoE gate_up and down; the routed GEMVs of three formats, gate_up and down, plain and
    # fused; the verify
    # rows' delta rule; the fused DeltaNet step's two kernels, decode and verify; the split verify step's inputs
    # kernel; the gated attention's two; a DFlash drafter's block attention, split and merge; peer all-reduce,
    # all-gather
    assert len(reports) == 3 * len(CASES) + 2 + 12 + 1 + 4 + 1 + 2 + 2 + 2
    assert any(r.label.startswith("gated_delta_finish_verify") for r in reports)
    for r in reports:
        assert r.problems == [], (r.label, r.problems)
        assert 0 < r.registers <= 255 and r.ldg128 > 0 and r.blocks_per_sm >= 1
