"""The offline SM80+ build of the packed many-row GEMM and the paged decode's split kernel
(engine/kernel_tools/triton_sm90.py, `onecat kernels check --arch sm_90`): where Triton and ptxas 12.x are installed,
every format and word layout at its default config for 17-128 rows, the grouped launch on a MoE layer's expert
stacks, the split kernel with and without the new tokens' RoPE in it and qk_rope_cache's kernel, compile for sm_90
without spills and within SM86/89's shared memory (the Triton interpreter cannot tell: it runs what a GPU build
refuses)."""
from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner


def test_packed_rows_gemm_builds_for_sm90_without_spills(tmp_path):
    from onecat.cli.kernels import app
    from onecat.engine.kernel_tools.toolchain import ToolchainMissing, find_toolchain
    from onecat.engine.kernel_tools.triton_sm70 import triton_unavailable_reason
    from onecat.engine.kernel_tools.triton_sm90 import GROUPED_LAYOUTS, LAYOUTS, ROWS, SPLIT_CASES

    reason = triton_unavailable_reason()
    if reason:
        pytest.skip(reason)
    try:
        find_toolchain()
    except ToolchainMissing as e:
        pytest.skip(str(e))
    out = tmp_path / "sm90.json"
    result = CliRunner().invoke(app, ["check", "--arch", "sm_90", "--json", str(out)])
    assert result.exit_code == 0, result.output
    reports = json.loads(out.read_text())["kernels"]
    assert len(reports) == len(LAYOUTS) * len(ROWS) + len(GROUPED_LAYOUTS) + len(SPLIT_CASES) + 4
    assert sum(r["label"].endswith("_rope") for r in reports) == len(SPLIT_CASES) // 2
    assert sum(r["label"].startswith("moe_grouped_") for r in reports) == len(GROUPED_LAYOUTS)
    for r in reports:
        assert r["problems"] == [], (r["label"], r["problems"])
        assert 0 < r["registers"] <= 255 and r["spill_bytes"] == 0, r
        assert r["shared_bytes"] > 0 or r["label"].startswith("qk_rope_cache"), r  # that one stages nothing
