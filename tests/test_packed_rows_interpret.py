"""The packed many-row GEMM (engine/kernels/triton_packed_rows.py) under Triton's interpreter (CPU): for NVFP4 and
MXFP4 (words row-major or in the tensor-core GEMV's tiles, codes in fp4.layout's places or in an activation dtype's
code slots, fp16's and bf16's), W4A16 (groups of 32, 64 and 128, row-major or tiled) and FP8 (row-major or tiled),
its product must be the dequantized weight's (the tile it decodes is exactly what triton_fp4.dequantize writes, so
only the float32 summation order differs). Activations are fp16 here: the interpreter's float32 -> bf16 conversion
inside a kernel gives wrong bits (a plain tl.dot of a converted tile is off by 1e10), so bf16 activations are
checked on the GPU (tests/test_packed_rows_gpu.py). The 2-8-row FP4 tensor-core GEMV (triton_fp4_dot.py), which
decodes its codes with the same helpers (triton_fp4.code_places / code_bits), is held to the same product."""
from __future__ import annotations

import pytest

from tests.triton_interpret import run_interpreted

pytest.importorskip("triton")

SCRIPT = r"""
import torch
from onecat.engine.kernels import quant_gemv
from onecat.engine.kernels.triton_packed_rows import config
assert config(40, 48, 256)[4] == 2 and config(128, 5120, 5120, 0)[:3] == (64, 128, 8)  # NVFP4: 8 warps past 64 rows
assert config(128, 5120, 5120, 2)[2:] == (4, 2, 2) and config(128, 5120, 6144, 0)[2:] == (8, 2, 1)  # o: W4A16 / NVFP4
assert config(128, 5120, 17408, 2)[4] == 4 and config(128, 34816, 5120, 2)[4] == 1  # down, gate_up
from onecat.engine.kernels.triton_packed_rows import fp4_rows_gemm, fp8_rows_gemm, w4a16_rows_gemm
from onecat.engine.quant.fp8 import layout as fp8_layout
from onecat.engine.quant.fp4.layout import dequantize
from onecat.engine.quant.w4a16.layout import dequantize as w4_dequantize
from onecat.engine.quant.fp4.slots import to_slots
from onecat.engine.quant.rtn import quantize

torch.manual_seed(0)
for fmt, fmt_id in (("nvfp4", 0), ("mxfp4", 1)):
    n, k = 48, 256
    packed = quantize(torch.randn(n, k) * 0.1, fmt)
    dense = dequantize(packed)
    gscale = packed.gscale if packed.gscale is not None else torch.ones(n)
    dtype = torch.float16
    if True:
        for rows in (17, 40):
            x = torch.randn(rows, k).to(dtype)
            ref = x.float() @ dense.to(dtype).float().T
            for tiled in (False, True):
                for slots in (None, torch.float16, torch.bfloat16):
                    words = packed.qweight if slots is None else to_slots(packed.qweight, slots, fmt)
                    if tiled:
                        words = quant_gemv.mma_tiles(words, fmt)
                    for cfg in (None, (32, 64, 4, 2, 1)):  # the default (K split in two here), and unsplit
                        y = fp4_rows_gemm(x, words, packed.scales, gscale, fmt_id, tiled=int(tiled), slots=slots,
                                          cfg=cfg)
                        assert y.shape == (rows, n) and y.dtype == dtype
                        err = ((y.float() - ref).abs() / (ref.abs() + 1.0)).max().item()
                        assert err < 1e-2, (fmt, dtype, rows, tiled, slots, cfg, err)
for group in (32, 64, 128):
    n, k = 48, 256
    packed = quantize(torch.randn(n, k) * 0.1, "w4a16", group=group)
    dense = w4_dequantize(packed).to(torch.float16).float()
    for rows in (17, 33):
        x = torch.randn(rows, k).to(torch.float16)
        ref = x.float() @ dense.T
        for tiled in (False, True):
            words = quant_gemv.mma_tiles(packed.qweight, "int4") if tiled else packed.qweight
            y = w4a16_rows_gemm(x, words, packed.scales, packed.zeros, group, tiled=int(tiled))
            assert y.shape == (rows, n) and y.dtype == torch.float16
            err = ((y.float() - ref).abs() / (ref.abs() + 1.0)).max().item()
            assert err < 1e-2, ("w4a16", group, rows, tiled, err)
n, k = 48, 256
packed = fp8_layout.pack_fp8((torch.randn(n, k) * 40).to(torch.float8_e4m3fn), torch.rand(n) * 1e-2 + 1e-3)
dense = fp8_layout.dequantize(packed).to(torch.float16).float()
for rows in (17, 33):
    x = torch.randn(rows, k).to(torch.float16)
    ref = x.float() @ dense.T
    for tiled in (False, True):
        words = quant_gemv.mma_tiles(packed.qweight, "fp8") if tiled else packed.qweight
        y = fp8_rows_gemm(x, words, packed.scale, tiled=int(tiled))
        err = ((y.float() - ref).abs() / (ref.abs() + 1.0)).max().item()
        assert y.shape == (rows, n) and err < 1e-2, ("fp8", rows, tiled, err)
print("ok")
"""


def test_packed_rows_gemm_equals_the_dequantized_product_in_every_format_and_word_layout():
    run_interpreted(SCRIPT, timeout=400)


DOT_SCRIPT = r"""
import torch
from onecat.engine.kernels import triton_fp4_dot
from onecat.engine.quant.fp4.layout import dequantize
from onecat.engine.quant.rtn import quantize

torch.manual_seed(1)
for fmt, fmt_id in (("nvfp4", 0), ("mxfp4", 1)):
    n, k = 40, 512
    packed = quantize(torch.randn(n, k) * 0.1, fmt)
    gscale = packed.gscale if packed.gscale is not None else torch.ones(n)
    for rows, split in ((3, 1), (8, 2)):
        x = torch.randn(rows, k).to(torch.float16)
        out = torch.zeros(split, rows, n, dtype=torch.float32 if split > 1 else torch.float16)
        triton_fp4_dot.launch(x, packed.qweight, packed.scales, gscale, out, fmt_id, 32, 4, 1, split)
        y = out.float().sum(0)
        ref = x.float() @ dequantize(packed).to(torch.float16).float().T
        err = ((y - ref).abs() / (ref.abs() + 1.0)).max().item()
        assert err < 1e-2, (fmt, rows, split, err)
print("ok")
"""


def test_fp4_tensor_core_gemv_equals_the_dequantized_product():
    run_interpreted(DOT_SCRIPT, timeout=300)
