"""The fused MoE kernels built ahead of time, no GPU needed (skipped where Triton is not importable): the `fma`
variant has no matrix instruction for sm_70 or sm_90a (Triton turns a multiply-reduce inside the K loop into a
dot, which on SM80+ would run float32 as tf32), builds for sm_70 without spills, and the `dot` variant does
use the matrix units on sm_90a; the decode GEMVs (triton_moe_gemv.py) have no matrix instruction and build for
sm_70 without spills."""
from __future__ import annotations

import re
import subprocess
import tempfile
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")

from onecat.engine.kernels import triton_moe, triton_moe_gemv  # noqa: E402


def _ptx(kernel, dtype: str, cap: int, variant: str, K: int) -> str:
    t = triton_moe.tiles(8, variant)
    const = {"K": K, "BM": t["BM"], "BN": t["BN"], "BK": t["BK"], "USE_DOT": variant == "dot",
             "PRECISION": "ieee" if dtype == "fp32" else "tf32", "PDL": cap >= 90}  # as pdl.options launches them
    return _build(kernel, dtype, cap, const, t["num_warps"], t["num_stages"])


def _gemv_ptx(kernel, dtype: str, cap: int, K: int, glu: bool) -> str:
    block_n, block_k, warps = triton_moe_gemv.config(K, glu)
    const = {"K": K, "BLOCK_N": block_n, "BLOCK_K": block_k, "PDL": cap >= 90, "TOP_K": 8,
             "K_PAD": triton_moe_gemv.k_pad(8)}
    return _build(kernel, dtype, cap, {k: v for k, v in const.items() if k in kernel.arg_names}, warps, 1)


def _build(kernel, dtype: str, cap: int, const: dict, num_warps: int, num_stages: int) -> str:
    from triton.backends.compiler import GPUTarget

    names = kernel.arg_names
    sig = {}
    for a in names:
        if a in ("x_ptr", "h_ptr", "w_ptr", "out_ptr", "sum_ptr"):
            sig[a] = "*" + dtype
        elif a in ("pairs_ptr", "experts_ptr", "ids_ptr"):
            sig[a] = "*i32"
        elif a == "route_ptr":
            sig[a] = "*fp32"
        elif a in ("K", "BM", "BN", "BK", "USE_DOT", "PRECISION", "PDL", "TOP_K", "K_PAD", "BLOCK_N", "BLOCK_K"):
            sig[a] = "constexpr"
        else:
            sig[a] = "i32"
    src = triton.compiler.ASTSource(fn=kernel, signature=sig,
                                    constexprs={(names.index(k),): v for k, v in const.items()})
    return triton.compile(src, target=GPUTarget("cuda", cap, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages,
                                   "launch_pdl": cap >= 90}).asm["ptx"]


def _matrix_ops(ptx: str) -> int:
    return len(re.findall(r"\b(?:mma|wgmma)\.", ptx))


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("cap", [70, 90])
def test_fma_variant_has_no_matrix_instructions(dtype, cap):
    for kernel, K in zip((triton_moe.gate_up_kernel, triton_moe.down_kernel), (2048, 768)):
        ptx = _ptx(kernel, dtype, cap, "fma", K)
        assert _matrix_ops(ptx) == 0 and "fma.rn.f32" in ptx
        assert ("griddepcontrol.wait" in ptx) == (cap >= 90)  # no PDL below SM90


def test_dot_variant_uses_the_matrix_units_on_sm90():
    for kernel, K in zip((triton_moe.gate_up_kernel, triton_moe.down_kernel), (2048, 768)):
        ptx = _ptx(kernel, "bf16", 90, "dot", K)
        assert _matrix_ops(ptx) > 0 and "griddepcontrol.wait" in ptx  # and waits for the kernel before it


def _assert_sm70_no_spills(ptx: str) -> None:
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.exists():
        pytest.skip("Triton's bundled ptxas is not there")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        out = subprocess.run([str(ptxas), "-v", "--gpu-name=sm_70", f.name, "-o", "/dev/null"],
                             capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-500:]
    assert "0 bytes spill stores" in out.stderr and "0 bytes spill loads" in out.stderr, out.stderr[-500:]


def test_fma_variant_builds_for_sm70_without_spills():
    for kernel, K in zip((triton_moe.gate_up_kernel, triton_moe.down_kernel), (2048, 768)):
        _assert_sm70_no_spills(_ptx(kernel, "fp16", 70, "fma", K))


@pytest.mark.parametrize("dtype,cap", [("fp16", 70), ("fp32", 70), ("bf16", 90)])
def test_decode_gemvs_use_plain_multiply_adds_and_build_for_sm70(dtype, cap):
    """The Qwen3-30B-A3B widths: gate_up over 2048 inputs, down over 768."""
    kernels = (triton_moe_gemv.gate_up_kernel, triton_moe_gemv.down_kernel)
    for kernel, K, glu in zip(kernels, (2048, 768), (True, False)):
        ptx = _gemv_ptx(kernel, dtype, cap, K, glu)
        assert _matrix_ops(ptx) == 0 and "fma.rn.f32" in ptx
        assert ("griddepcontrol.wait" in ptx) == (cap >= 90)
        if cap == 70:
            _assert_sm70_no_spills(ptx)
