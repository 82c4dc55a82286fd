"""The dense weight of packed FP8 (E4M3) words, for the library GEMM of a prefill (engine/quant/fp8/linear.py):
one pass on the GPU, one lane per output column (contiguous stores), where the torch form takes four passes
over float32 temporaries.

Layout (engine/quant/fp8/layout.py): int32 words [N, K / 4]; in each block of 16 columns, byte j of word i is
column 4 j + i. A byte's sign moved to bit 31 and its exponent and mantissa bits to bits 20-26 of a float32 give
e4m3 * 2^-120 exactly (subnormals included), times 2^120 the code, times the row's float32 scale rounded once to
the dtype: the bits of fp8.layout.dequantize(w).to(dtype).
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def fp8_dequant_kernel(q_ptr, s_ptr, w_ptr, N, K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    ok = (rows < N)[:, None] & (cols < K)[None, :]
    rows = tl.where(rows < N, rows, 0).to(tl.int64)[:, None]
    word = (cols // 16) * 4 + cols % 4
    shift = (8 * ((cols % 16) // 4)).to(tl.uint32)
    words = tl.load(q_ptr + rows * (K // 4) + word[None, :], mask=ok, other=0).to(tl.uint32, bitcast=True)
    b = (words >> shift[None, :]) & 0xFF
    value = (((b & 0x80) << 24) | ((b & 0x7F) << 20)).to(tl.float32, bitcast=True) * (2.0 ** 120)  # exact
    scale = tl.load(s_ptr + rows)
    tl.store(w_ptr + rows * K + cols[None, :], (value * scale).to(w_ptr.dtype.element_ty), mask=ok)


def dequantize(qweight, scale, dtype):
    """The dense [N, K] weight in `dtype` of row-major FP8 words [N, K / 4] and float32 row scales [N], on their
    device."""
    import torch

    n, kw = qweight.shape
    w = torch.empty(n, kw * 4, dtype=dtype, device=qweight.device)
    block_n, block_k = 16, 256
    fp8_dequant_kernel[(-(-n // block_n), -(-kw * 4 // block_k))](qweight, scale, w, n, K=kw * 4, BLOCK_N=block_n,
                                                                  BLOCK_K=block_k, num_warps=4)
    return w
