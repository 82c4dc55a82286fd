"""The count of Triton kernel variants built in the process (engine/kernels/triton_builds.py): every cache miss
Triton reports is counted in order, a hook set before keeps being called and keeps its answer."""
import pytest

triton = pytest.importorskip("triton")
knobs = pytest.importorskip("triton.knobs")

from onecat.engine.kernels import triton_builds  # noqa: E402


def test_builds_are_counted_in_order_and_the_earlier_hook_still_answers(monkeypatch):
    if not hasattr(knobs.runtime, "jit_cache_hook"):
        pytest.skip("this Triton has no jit_cache_hook")
    earlier = []
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", lambda **kw: earlier.append(kw["repr"]) or "skip")
    monkeypatch.setattr(triton_builds, "_installed", False)
    monkeypatch.setattr(triton_builds, "_built", [])
    assert triton_builds.install()
    start = triton_builds.mark()
    hook = knobs.runtime.jit_cache_hook
    assert hook(key=None, repr="step_kernel[num_warps=4](x: *bf16, n: i32)", fn=None) == "skip"
    assert hook(key=None, repr="split_kernel[num_warps=8](y: *fp32, n: constexpr)", fn=None) == "skip"
    assert triton_builds.since(start) == ["step_kernel[num_warps=4](x: *bf16, n: i32)",
                                          "split_kernel[num_warps=8](y: *fp32, n: constexpr)"]
    assert earlier == triton_builds.since(start)
    hook(key=None, repr="step_kernel[num_warps=4](x: *fp16, n: i32)", fn=None)
    assert triton_builds.describe(start) == {"count": 3, "by_kernel": {"step_kernel": 2, "split_kernel": 1}}
    assert triton_builds.describe(start + 1) == {"count": 2, "by_kernel": {"split_kernel": 1, "step_kernel": 1}}
    assert triton_builds.install()  # once per process: not wrapped twice
    assert knobs.runtime.jit_cache_hook is hook


def test_aligned_copies_only_views_off_a_16_byte_boundary():
    import torch

    base = torch.arange(40, dtype=torch.float32)
    assert triton_builds.aligned(base) is base
    assert triton_builds.aligned(base[4:]).data_ptr() == base[4:].data_ptr()  # 16 bytes in: kept
    off = base[1:9]  # 4 bytes past the start
    copy = triton_builds.aligned(off)
    assert copy.data_ptr() % 16 == 0 and copy.data_ptr() != off.data_ptr() and torch.equal(copy, off)
    rows = base.view(8, 5)[1:3, :4]  # a strided view off the boundary: a contiguous copy
    assert triton_builds.aligned(rows).is_contiguous() and torch.equal(triton_builds.aligned(rows), rows)
