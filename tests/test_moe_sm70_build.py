"""The fused MoE kernels built ahead of time, no GPU needed (skipped where Triton is not importable): the `fma`
variant has no matrix instruction for sm_70 or sm_90a (Triton turns a multiply-reduce inside the K loop into a
dot, which on SM80+ would run float32 as tf32), builds for sm_70 without spills (the one-token down kernel with
its ticket included), and the `dot` variant does use the matrix units on sm_90a."""
from __future__ import annotations

import re
import subprocess
import tempfile
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")

from onecat.engine.kernels import triton_moe  # noqa: E402


def _ptx(kernel, dtype: str, cap: int, variant: str, K: int) -> str:
    from triton.backends.compiler import GPUTarget

    t = triton_moe.tiles(8, variant)
    names = kernel.arg_names
    sig = {}
    for a in names:
        if a in ("x_ptr", "h_ptr", "w_ptr", "out_ptr", "sum_ptr"):
            sig[a] = "*" + dtype
        elif a in ("pairs_ptr", "experts_ptr", "ticket_ptr"):
            sig[a] = "*i32"
        elif a == "route_ptr":
            sig[a] = "*fp32"
        elif a in ("K", "BM", "BN", "BK", "USE_DOT", "PRECISION", "COMBINE_K", "PDL"):
            sig[a] = "constexpr"
        else:
            sig[a] = "i32"
    const = {"K": K, "BM": t["BM"], "BN": t["BN"], "BK": t["BK"], "USE_DOT": variant == "dot",
             "PRECISION": "ieee" if dtype == "fp32" else "tf32", "PDL": cap >= 90}  # as pdl.options launches them
    if "COMBINE_K" in names:
        const["COMBINE_K"] = 8  # the one-token down kernel: its ticket and its sum of the k rows included
    src = triton.compiler.ASTSource(fn=kernel, signature=sig,
                                    constexprs={(names.index(k),): v for k, v in const.items()})
    return triton.compile(src, target=GPUTarget("cuda", cap, 32),
                          options={"num_warps": t["num_warps"], "num_stages": t["num_stages"],
                                   "launch_pdl": cap >= 90}).asm["ptx"]


def _matrix_ops(ptx: str) -> int:
    return len(re.findall(r"\b(?:mma|wgmma)\.", ptx))


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("cap", [70, 90])
def test_fma_variant_has_no_matrix_instructions(dtype, cap):
    for kernel, K in zip(triton_moe._kernels(), (2048, 768)):
        ptx = _ptx(kernel, dtype, cap, "fma", K)
        assert _matrix_ops(ptx) == 0 and "fma.rn.f32" in ptx
        assert ("griddepcontrol.wait" in ptx) == (cap >= 90)  # no PDL below SM90


def test_dot_variant_uses_the_matrix_units_on_sm90():
    for kernel, K in zip(triton_moe._kernels(), (2048, 768)):
        ptx = _ptx(kernel, "bf16", 90, "dot", K)
        assert _matrix_ops(ptx) > 0 and "griddepcontrol.wait" in ptx  # and waits for the kernel before it


def test_fma_variant_builds_for_sm70_without_spills():
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.exists():
        pytest.skip("Triton's bundled ptxas is not there")
    for kernel, K in zip(triton_moe._kernels(), (2048, 768)):
        with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
            f.write(_ptx(kernel, "fp16", 70, "fma", K))
            f.flush()
            out = subprocess.run([str(ptxas), "-v", "--gpu-name=sm_70", f.name, "-o", "/dev/null"],
                                 capture_output=True, text=True)
        assert out.returncode == 0, out.stderr[-500:]
        assert "0 bytes spill stores" in out.stderr and "0 bytes spill loads" in out.stderr, out.stderr[-500:]
