"""`onecat kernels check --arch sm_70`: the offline V100 build check of the attention kernels.

The full check needs the CUDA 12.x chain (pip install "onecat[sm70]" and
`onecat kernels fetch-nvdisasm`); without it those tests skip with the reason. Occupancy math
and the missing-toolchain message are tested everywhere.
"""
from __future__ import annotations

import pytest
from typer.testing import CliRunner

from onecat.cli.kernels import app
from onecat.engine.kernel_tools import toolchain
from onecat.engine.kernel_tools.sm70_check import v100_occupancy


def _toolchain_or_skip():
    try:
        return toolchain.find_toolchain()
    except toolchain.ToolchainMissing as exc:
        pytest.skip(str(exc))


def test_v100_occupancy_limits():
    # 128 threads, 64 regs: 4 warps * 2048 regs -> 8 CTAs by registers, 16 by threads.
    assert v100_occupancy(64, 0, 128) == (8, 0.5, "registers")
    # 40 KB dynamic shared memory -> 2 CTAs in 96 KB.
    assert v100_occupancy(32, 40 * 1024, 128)[:1] == (2,)
    assert v100_occupancy(32, 40 * 1024, 128)[2] == "shared memory"
    # 255 registers round up to 8192 per warp: 2 CTAs of 4 warps.
    assert v100_occupancy(255, 0, 128)[0] == 2


def test_missing_toolchain_names_pip_command(monkeypatch):
    monkeypatch.setattr(toolchain, "_nvidia_dir", lambda sub: None)
    with pytest.raises(toolchain.ToolchainMissing) as info:
        toolchain.find_toolchain()
    msg = str(info.value)
    assert "nvidia-cuda-nvrtc-cu12" in msg and "pip install" in msg


def test_cli_rejects_other_arch():
    result = CliRunner().invoke(app, ["check", "--arch", "sm_80"])
    assert result.exit_code == 2
    assert "sm_80" in result.output


def test_cli_reports_missing_toolchain(monkeypatch):
    monkeypatch.setattr(toolchain, "_nvidia_dir", lambda sub: None)
    result = CliRunner().invoke(app, ["check", "--arch", "sm_70"])
    assert result.exit_code == 3
    assert "pip install" in result.output


def test_sm70_check_cli_passes_with_tensor_cores_and_128bit_loads(tmp_path, monkeypatch):
    _toolchain_or_skip()
    import itertools
    import json

    from onecat.engine.kernel_tools import triton_sm70

    # Every CUDA kernel is built here; of the Triton kernels only the first, for the CLI's path through their
    # reports (table, JSON, exit code): tests/test_triton_sm70.py builds all of them with run_triton_check.
    if triton_sm70.triton_unavailable_reason() is None:
        cases = triton_sm70._cases
        monkeypatch.setattr(triton_sm70, "_cases", lambda: itertools.islice(cases(), 1))
    out = tmp_path / "report.json"
    result = CliRunner().invoke(app, ["check", "--arch", "sm_70", "--json", str(out)])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    from onecat.engine.kernel_tools.sm70_check import kernel_specs

    assert data["arch"] == "sm_70" and len(data["kernels"]) == len(kernel_specs())
    assert len(data["triton_kernels"]) == (triton_sm70.triton_unavailable_reason() is None)
    for r in data["triton_kernels"]:
        assert not r["problems"] and r["spill_stores"] == 0 and r["ldg128"] > 0, r["label"]
    for r in data["kernels"]:
        label = r["label"]
        assert not r["problems"], (label, r["problems"])
        assert r["spill_stores"] == 0 and r["spill_loads"] == 0, label
        assert r["blocks_per_sm"] >= 1 and r["smem"] <= 96 * 1024, label
        if label.startswith("prefill"):
            assert r["hmma"] > 0, label  # tensor cores present in the sm_70 SASS
        if label.startswith("decode"):
            assert r["ldg128"] > 0, label  # paged KV read with 128-bit loads


def test_tensor_core_gemv_builds_for_volta_as_a_trap_and_for_ampere_with_mma():
    """A V100 build of the extension compiles mma_gemv.cuh too (the binding never launches it below SM80): it must
    compile for compute_70 with no mma.sync (a trap instead), and for compute_80 with the mma of every format."""
    from onecat.engine.kernel_tools.nvrtc import Nvrtc
    from onecat.engine.kernel_tools.sm70_check import CSRC

    tc = _toolchain_or_skip()
    exprs = [f"&onecat_qgemv::mma_gemv_kernel<onecat_qgemv::{fmt}, {t}, 1, 2, 4>"  # each decode, both packs
             for fmt, t in [("kInt4H", "__half"), ("kNvfp4", "__half"), ("kMxfp4", "__nv_bfloat16"),
                            ("kFp8", "__nv_bfloat16"), ("kDense", "__half"), ("kDense", "__nv_bfloat16")]]
    ptx = {}
    for arch in ("compute_70", "compute_80"):
        ptx[arch], lowered = Nvrtc(tc.nvrtc_lib).compile(
            '#include "quant_gemv/mma_gemv.cuh"\n', "mma_gemv.cu",
            [f"--gpu-architecture={arch}", "--std=c++17", f"-I{CSRC}", f"-I{tc.cuda_include}"], exprs)
        assert len(lowered) == len(exprs)
    assert "mma.sync" not in ptx["compute_70"] and "trap;" in ptx["compute_70"]
    assert ptx["compute_80"].count("mma.sync.aligned.m16n8k16") >= len(exprs) * 8  # 8 k-steps a run, each one
    assert "trap;" not in ptx["compute_80"]
