"""The tensor-core GEMV's 9-16-row calls (two B operands, csrc/quant_gemv/mma_gemv.cuh NB = 2) on a GPU (skipped
without CUDA, the extension or SM80): each row's output is the bits its 8-row call gives (the same products, sums
and splits), for every format and word layout, with glu too; packed_gemv_blocks with ONECAT_GEMV_16_ROWS on gives
the bits it gives off (8-row calls) at 9-32 rows, in half the calls; the FMA GEMV still refuses more than 8."""
from __future__ import annotations

import pytest
import torch

from tests.test_quant_gemv_gpu import TILE_CASES, make, run

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(autouse=True)
def _sm80():
    from onecat.engine.kernels.device import capability
    from onecat.engine.kernels.quant_gemv import EXTENSION

    reason = EXTENSION.prerequisites_missing()
    if reason:
        pytest.skip(reason)
    EXTENSION.load()
    if capability(0) < 80:
        pytest.skip("the tensor-core GEMV needs SM80+")


def _layouts(fmt: str, dtype: torch.dtype, args: dict) -> list[tuple[int, torch.Tensor]]:
    """(layout, words): row-major and the layout a packed layer keeps."""
    from onecat.engine.kernels.quant_gemv import ROW_MAJOR, SLOT_DTYPES, mma_layout, mma_tiles
    from onecat.engine.quant.fp4.slots import to_slots

    if args["qweight"].shape[0] % 16:  # tiles are whole 16-row tiles: an odd N keeps the row-major words
        return [(ROW_MAJOR, args["qweight"])]
    layout = mma_layout(fmt, dtype, args["scales"])
    words = to_slots(args["qweight"], dtype, fmt) if layout in SLOT_DTYPES else args["qweight"]
    return [(ROW_MAJOR, args["qweight"]), (layout, mma_tiles(words, fmt))]


@pytest.mark.parametrize("fmt,dtype", TILE_CASES)
@pytest.mark.parametrize("n,k", [(300, 4096), (4101, 1024), (48, 14336)])
def test_rows_9_to_16_give_the_bits_of_8_row_calls(fmt, dtype, n, k):
    from onecat.engine.kernels.quant_gemv import packed_gemv

    args, _ = make(fmt, n, k, seed=n + k)
    operands = (args["scales"], args.get("row_scale"), args.get("group", 0))
    for layout, words in _layouts(fmt, dtype, args):
        for rows in (9, 13, 16):
            x = torch.randn(rows, k, device="cuda", dtype=dtype)
            for splits in (0, 1, 2):
                y = packed_gemv(x, fmt, words, *operands, splits, kernel="mma", tiled=layout)
                halves = torch.cat([packed_gemv(x[:8].contiguous(), fmt, words, *operands, splits, kernel="mma",
                                                tiled=layout),
                                    packed_gemv(x[8:].contiguous(), fmt, words, *operands, splits, kernel="mma",
                                                tiled=layout)])
                assert y.shape == (rows, n) and torch.equal(y, halves), f"layout {layout}, {rows} rows, splits {splits}"
                one = packed_gemv(x[rows - 1:].contiguous(), fmt, words, *operands, splits, kernel="mma", tiled=layout)
                assert torch.equal(y[rows - 1:], one), f"the last row alone, layout {layout}, splits {splits}"


@pytest.mark.parametrize("fmt,dtype", TILE_CASES)
def test_glu_at_16_rows_gives_the_separate_silu_mul_bits(fmt, dtype):
    from onecat.engine.kernels.quant_gemv import packed_gemv
    from onecat.engine.kernels.triton_fused import silu_mul

    k, inter = 1024, 160
    args, _ = make(fmt, 2 * inter, k, seed=23)
    operands = (args["scales"], args.get("row_scale"), args.get("group", 0))
    for layout, words in _layouts(fmt, dtype, args):
        for rows in (11, 16):
            x = torch.randn(rows, k, device="cuda", dtype=dtype)
            for splits in (0, 2):
                want = silu_mul(packed_gemv(x, fmt, words, *operands, splits, kernel="mma", tiled=layout))
                act = packed_gemv(x, fmt, words, *operands, splits, glu=True, kernel="mma", tiled=layout)
                assert act.shape == (rows, inter) and torch.equal(act, want), f"{layout} {rows} rows {splits}"


@pytest.mark.parametrize("fmt,dtype", [("int4", torch.float16), ("nvfp4", torch.bfloat16), ("fp8", torch.float16),
                                       ("mxfp4", torch.bfloat16)])
def test_blocks_of_16_give_the_bits_of_blocks_of_8(fmt, dtype, monkeypatch):
    from onecat.engine.kernels import quant_gemv

    args, _ = make(fmt, 1000, 4096, seed=5)
    calls = []
    real = quant_gemv.packed_gemv
    monkeypatch.setattr(quant_gemv, "packed_gemv", lambda x, *a, **kw: calls.append(x.numel() // 4096) or real(x, *a, **kw))
    operands = (fmt, args["qweight"], args["scales"], args.get("row_scale"), args.get("group", 0))
    for rows in (9, 16, 17, 32):
        x = torch.randn(rows, 4096, device="cuda", dtype=dtype)
        monkeypatch.setattr(quant_gemv, "MMA_16_ROWS", False)
        calls.clear()
        eights = quant_gemv.packed_gemv_blocks(x, *operands)
        assert calls == [min(8, rows - i) for i in range(0, rows, 8)], calls
        monkeypatch.setattr(quant_gemv, "MMA_16_ROWS", True)
        calls.clear()
        sixteens = quant_gemv.packed_gemv_blocks(x, *operands)
        assert calls == [min(16, rows - i) for i in range(0, rows, 16)], calls
        assert torch.equal(sixteens, eights), f"{rows} rows"


def test_more_than_8_rows_off_the_tensor_cores_are_refused():
    args, _ = make("nvfp4", 256, 1024, seed=3)
    x = torch.randn(9, 1024, device="cuda", dtype=torch.float16)
    with pytest.raises(ValueError, match="1 to 8 rows .off the tensor cores."):
        run(x, "nvfp4", args, kernel="fma")
    with pytest.raises(ValueError, match="1 to 16 rows"):
        run(torch.randn(17, 1024, device="cuda", dtype=torch.float16), "nvfp4", args, kernel="mma")
