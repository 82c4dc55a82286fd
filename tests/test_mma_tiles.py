"""The tensor-core GEMV's tiled weight layout (engine/kernels/quant_gemv.py mma_tiles): where each word goes, and
back. Pure torch, so it runs on CPU; tests/test_quant_gemv_gpu.py checks the kernel reads it to the same bits."""
from __future__ import annotations

import pytest
import torch

from onecat.engine.kernels.quant_gemv import mma_tiles, mma_untile


@pytest.mark.parametrize("fmt,words_per_run", [("int4", 16), ("nvfp4", 16), ("fp8", 32)])
def test_each_tile_holds_its_sixteen_rows_of_one_run_and_untiles_back(fmt, words_per_run):
    n, runs = 48, 3
    w = torch.arange(n * runs * words_per_run, dtype=torch.int32).view(n, runs * words_per_run)
    t = mma_tiles(w, fmt)
    assert t.shape == w.shape
    flat = t.flatten()
    block = 16 * words_per_run
    for tile in range(n // 16):
        for run in range(runs):
            got = flat[(tile * runs + run) * block:(tile * runs + run + 1) * block].view(16, words_per_run)
            want = w[16 * tile:16 * tile + 16, run * words_per_run:(run + 1) * words_per_run]
            assert torch.equal(got, want), (tile, run)
    assert torch.equal(mma_untile(t, fmt), w)


def test_shapes_the_tiles_cannot_hold_are_refused():
    with pytest.raises(ValueError, match="multiple of 16"):
        mma_tiles(torch.zeros(40, 32, dtype=torch.int32), "int4")
    with pytest.raises(ValueError, match="multiple of 128"):
        mma_tiles(torch.zeros(32, 24, dtype=torch.int32), "int4")


def test_row_limits_of_one_gemv_call_and_of_its_blocks(monkeypatch):
    """One call takes 1-8 rows, 1-16 on the tensor cores (two B operands); packed_gemv_blocks cuts a call into blocks
    of 16 only where the tensor-core GEMV takes it and ONECAT_GEMV_16_ROWS is on (a CPU input: 8)."""
    from onecat.engine.kernels import quant_gemv

    w = torch.zeros(32, 1024 // 8, dtype=torch.int32)
    for rows, mma, refused in ((8, False, False), (9, False, True), (16, True, False), (17, True, True)):
        x = torch.zeros(rows, 1024, dtype=torch.float16)
        if refused:
            with pytest.raises(ValueError, match=f"1 to {16 if mma else 8} rows"):
                quant_gemv.check_call(x, "nvfp4", w, 0, mma=mma)
        else:
            quant_gemv.check_call(x, "nvfp4", w, 0, mma=mma)
    monkeypatch.setattr(quant_gemv, "MMA_16_ROWS", True)
    x = torch.zeros(12, 1024, dtype=torch.float16)
    assert quant_gemv.rows_per_call(x, "nvfp4", torch.zeros(32, 64, dtype=torch.uint8)) == quant_gemv.MAX_ROWS
