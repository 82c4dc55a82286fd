"""sass-model v1: SASS counting, loops, occupancy and bound selection on hand-written nvdisasm text;
the calibration kernels when the CUDA 12.x sm_70 toolchain is installed (skipped otherwise)."""
from __future__ import annotations

import pytest

from onecat.engine.kernel_tools import toolchain
from onecat.engine.kernel_tools import v100_limits as V
from onecat.engine.kernel_tools.sass_model import Launch, count, functions, loop_trips, outer_loop, project
from onecat.engine.kernel_tools.sm70_check import v100_occupancy

# A counted inner loop (4 trips, 2 HMMA + LDS.64 + LDG.E.128 each) inside a run-time outer loop with a
# barrier and an if/else whose longer arm has two FFMA, then a cold BRA.DIV path and the trailing trap.
SASS = """
        .section        .text.toy,"ax",@progbits
.text.toy:
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/              @!PT SHFL.IDX PT, RZ, RZ, RZ, RZ ;
        /*0020*/                   S2R R0, SR_TID.X ;
.L_x_0:
        /*0030*/                   MOV R9, RZ ;
.L_x_1:
        /*0040*/                   LDS.U.64 R2, [R0] ;
        /*0050*/                   LDG.E.128.SYS R12, [R4] ;
        /*0060*/                   HMMA.884.F32.F32.STEP0 R16, R2.ROW, R2.COL, R16 ;
        /*0070*/                   HMMA.884.F32.F32.STEP1 R18, R2.ROW, R2.COL, R18 ;
        /*0080*/                   IADD3 R9, R9, 0x1, RZ ;
        /*0090*/                   ISETP.NE.AND P0, PT, R9, 0x4, PT ;
        /*00a0*/               @P0 BRA `(.L_x_1) ;
        /*00b0*/                   BAR.SYNC 0x0 ;
        /*00c0*/               @P1 BRA `(.L_x_2) ;
        /*00d0*/                   FFMA R20, R20, R21, R22 ;
        /*00e0*/                   FFMA R20, R20, R21, R22 ;
        /*00f0*/                   BRA `(.L_x_3) ;
.L_x_2:
        /*0100*/                   FADD R20, R20, R21 ;
.L_x_3:
        /*0110*/                   MUFU.EX2 R23, R20 ;
        /*0120*/                   BRA.DIV `(.L_x_4) ;
        /*0130*/                   STS.128 [R0], R12 ;
        /*0140*/                   ISETP.NE.AND P2, PT, R10, R11, PT ;
        /*0150*/               @P2 BRA `(.L_x_0) ;
        /*0160*/                   EXIT ;
.L_x_4:
        /*0170*/                   FFMA R30, R30, R30, R30 ;
        /*0180*/                   BRA `(.L_x_3) ;
.L_x_5:
        /*0190*/                   BRA `(.L_x_5);
"""


def _toy():
    return functions(SASS)["toy"]


def test_loops_found_nested_with_counted_trip_count():
    fn = _toy()
    assert [(lp.head, lp.tail, lp.depth) for lp in fn.loops] == [(0x30, 0x150, 0), (0x40, 0xa0, 1)]
    assert fn.loops[0].trips is None and fn.loops[1].trips == 4.0
    assert outer_loop(fn) == 0
    trips, notes = loop_trips(fn)
    assert trips == [1.0, 4.0] and "loop 0" in notes[0]


def test_cold_paths_and_never_predicate_are_not_counted():
    fn = _toy()
    assert fn.weight[0x10] == 0.0  # @!PT
    assert fn.weight[0x170] == 0.0 and fn.weight[0x180] == 0.0  # reached only by BRA.DIV
    assert fn.weight[0x190] == 0.0  # trap after EXIT
    assert fn.weight[0x100] == 0.0 and fn.weight[0xd0] == 1.0  # shorter else-arm dropped


def test_counts_per_iteration_by_pipe_and_width():
    fn = _toy()
    once, per_iter = count(fn, [1.0, 4.0], outer=0)
    k = per_iter.by_kind
    assert k["hmma"] == 8 and k["lds64"] == 4 and k["ldg128"] == 4 and k["sts128"] == 1
    assert k["ffma"] == 2 and k["fadd"] == 0 and k["mufu"] == 1 and k["bar"] == 1
    assert per_iter.smem_bytes == 4 * 8 * 32 + 16 * 32
    assert per_iter.global_bytes == 4 * 16 * 32
    assert once.by_kind["int_other"] == 2 and once.by_kind["branch"] == 1  # MOV, S2R, EXIT


def test_v100_occupancy_math():
    assert v100_occupancy(168, 37376, 128) == (2, 0.125, "shared memory")
    assert v100_occupancy(249, 51712, 128)[0] == 1
    assert v100_occupancy(32, 0, 256)[:2] == (8, 1.0)  # threads and registers both allow 8


def test_bound_selection_picks_the_largest_time():
    fn = _toy()
    # No HBM traffic, one one-warp CTA per SM, 1000 outer iterations: check each bound's arithmetic
    # and that the largest one binds.
    launch = Launch(ctas=V.SMS, threads=32, outer_trips_total=V.SMS * 1000.0, registers=32, smem_bytes=0,
                    hbm_bytes=0.0, useful_flops=1.0)
    p = project(fn, launch, v100_occupancy(32, 0, 32))
    per_sm_clk = lambda ms: ms * 1e-3 * V.CLOCK_HZ  # noqa: E731
    assert per_sm_clk(p.bounds_ms["tensor"]) == pytest.approx(1000 * 8 * 256 / 512, rel=1e-6)
    assert per_sm_clk(p.bounds_ms["smem"]) == pytest.approx(1000 * (4 * 256 + 512) / 128, rel=1e-3)
    assert p.binding == max(p.bounds_ms, key=p.bounds_ms.get)
    assert p.label == "projected (sass-model v1)"
    heavy = Launch(V.SMS, 32, V.SMS * 1000.0, 32, 0, hbm_bytes=1e12, useful_flops=1.0)
    assert project(fn, heavy, v100_occupancy(32, 0, 32)).binding == "hbm"


def test_unresident_kernel_is_a_clear_error():
    with pytest.raises(ValueError, match="cannot be resident"):
        project(_toy(), Launch(1, 128, 1.0, 255, 200_000, 0.0, 1.0), (0, 0.0, "shared memory"))


def test_tensor_peak_is_125_tflops():
    assert V.PEAK_TENSOR_FLOPS / 1e12 == pytest.approx(125.3, abs=0.1)
    assert V.PEAK_FP32_FLOPS / 1e12 == pytest.approx(15.7, abs=0.05)


def test_calibration_kernels_rank_and_land_on_their_ideal():
    try:
        toolchain.find_toolchain()
    except toolchain.ToolchainMissing as exc:
        pytest.skip(str(exc))
    from onecat.engine.kernel_tools.sass_calibration import calibrate

    rows = {(r.kernel, r.reference): r for r in calibrate()}
    for name, pipe in (("cal_hmma", "tensor"), ("cal_ffma", "fp32"), ("cal_lds", "smem"), ("cal_copy", "hbm")):
        row = next(r for (k, _), r in rows.items() if k == name)
        assert row.model_binding == pipe and row.ratio == pytest.approx(1.0, abs=0.02), row
    gemm = [r for (k, _), r in rows.items() if k == "cal_gemm"]
    assert all(r.model_binding == "tensor" and 0.75 <= r.ratio <= 1.25 for r in gemm), gemm


def test_model_cli_reports_missing_toolchain_and_other_arch(monkeypatch, tmp_path):
    from typer.testing import CliRunner

    from onecat.cli.kernels import app

    assert CliRunner().invoke(app, ["model", "--arch", "sm_80", "--out", str(tmp_path / "m.json")]).exit_code == 2
    monkeypatch.setattr(toolchain, "_nvidia_dir", lambda sub: None)
    result = CliRunner().invoke(app, ["model", "--out", str(tmp_path / "m.json")])
    assert result.exit_code == 3 and "pip install" in result.output
