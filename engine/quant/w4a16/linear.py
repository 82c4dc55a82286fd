"""A linear layer whose weight stays packed 4-bit in GPU memory (the W4A16 layout of w4a16/layout.py).

Up to MAX_ROWS rows (decode steps) run the CUDA packed GEMVs (engine/kernels/quant_gemv.py: the tensor-core
one for fp16 with groups of 128 on SM80+, else the FMA one; batch-invariant), or the W4A16 GEMV of
engine/kernels/triton_w4a16.py where those are not built or ONECAT_QUANT_GEMV=triton; all dequantize in
registers; up to 64 rows in calls of 16 on the tensor cores, else 32 in calls of 8 (gemv_blocked_rows). Past
that up to 64 rows (where the GEMV stops at 32; ONECAT_PACKED_ROWS_GEMM=0 turns it off) decode the words as they
lie and multiply on the tensor cores (engine/kernels/triton_packed_rows.py: the weight read once, packed). More rows (prefill chunks, large batches) are compute-bound: the weight is
dequantized into a dense scratch copy in the activation dtype and the library GEMM runs on it, either the
whole weight at once or DENSE_TILE_ROWS output rows at a time (a smaller scratch). Measured on an H200 at
32 rows (benchmarks/results/gpu_h200_w4a16.json): the whole weight at once is as fast as 4096-row tiles
or faster (qkv 46 vs 55 us, gate_up 189 vs 225 us) and 1024-row tiles are slower still, so it is the
default; either is 2.4-3x slower than cuBLAS on fp16 weights.
On CPU the layer runs on the exactly dequantized weight (a reference path, not a fast one).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from onecat.engine.quant.tiled_words import TiledWords
from onecat.engine.quant.w4a16.layout import W4A16Weight, dequantize, scale_zero_pairs

DENSE_TILE_ROWS = 0  # output rows dequantized per GEMM above MAX_ROWS rows; 0: the whole weight at once


class W4A16Linear(TiledWords, nn.Module):
    """y = x @ W^T + b with W packed 4-bit (codes, per-group scales and zeros, optional input permutation)."""

    words_format = "int4"

    def __init__(self, weight: W4A16Weight, bias: torch.Tensor | None = None,
                 dense_tile_rows: int = DENSE_TILE_ROWS) -> None:
        super().__init__()
        self.in_features, self.out_features, self.group = weight.in_features, weight.out_features, weight.group
        self.register_buffer("qweight", weight.qweight)
        self.register_buffer("scales", weight.scales)
        self.register_buffer("zeros", weight.zeros)
        self.register_buffer("perm", weight.perm)
        self.register_buffer("scale_zero", scale_zero_pairs(weight.scales, weight.zeros))  # what the GEMV reads
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.dense_tile_rows = dense_tile_rows

    def packed(self) -> W4A16Weight:
        return W4A16Weight(self.row_major_words(), self.scales, self.zeros, self.group, self.perm)

    def use_tiles(self, act_dtype: torch.dtype) -> None:
        """Keep the words in the tensor-core GEMV's tiles where it takes this layer's calls (tiled_words.py)."""
        self.tile_words(act_dtype, self.scale_zero, self.group)

    def gemv_operands(self) -> tuple[str, torch.Tensor, None, int]:
        return "int4", self.scale_zero, None, self.group

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, w4 g{self.group}" + (
            ", act-order" if self.perm is not None else "")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"W4A16Linear takes {self.in_features} input features, got a {tuple(x.shape)} input")
        if not x.is_cuda:
            return F.linear(x, dequantize(self.packed()).to(x.dtype), self.bias)
        if self.perm is not None:
            x = x.index_select(-1, self.perm)
        x = x.contiguous()
        if self._cuda_gemv_takes(x):
            from onecat.engine.kernels.quant_gemv import packed_gemv_blocks

            fmt, scales, row_scale, group = self.gemv_operands()
            y = packed_gemv_blocks(x, fmt, self.qweight, scales, row_scale, group, tiled=self.tiled)
            return y if self.bias is None else y + self.bias
        y = self.packed_rows(x)  # x already permuted where the layer has act-order
        if y is not None:
            return y
        from onecat.engine.kernels import triton_w4a16 as kw

        if not self.tiled and kw.w4a16_unsupported_reason(x, self.qweight, self.group) is None:
            y = kw.w4a16_gemv(x, self.qweight, self.scale_zero, self.group)
            return y if self.bias is None else y + self.bias
        return self._dense(x)

    def rows_gemm(self, x: torch.Tensor) -> torch.Tensor:
        from onecat.engine.kernels.triton_packed_rows import w4a16_rows_gemm

        return w4a16_rows_gemm(x, self.qweight, self.scales, self.zeros, self.group, self.tiled)

    def fused_norm_gemv(self, x: torch.Tensor, residual: torch.Tensor, norm, glu: bool):
        """(self(norm(x + residual)), x + residual) in one CUDA kernel (glu: SiLU(gate) * up of it), or None where
        that kernel does not take the call (engine/kernels/quant_gemv.py folded_call; act-order layers: never)."""
        if self.perm is not None or self.tiled or x.shape[-1] != self.in_features:
            return None
        from onecat.engine.kernels import quant_gemv

        return quant_gemv.folded_call(self, x, residual, norm, glu, "int4", self.qweight, self.scale_zero,
                                      group=self.group)

    def _cuda_gemv_takes(self, x: torch.Tensor) -> bool:
        """The CUDA packed GEMVs (engine/kernels/quant_gemv.py) take 1-64 fp16/bf16 rows (in calls of 8 or 16,
        gemv_blocked_rows) with fp16/bf16 scales, wherever they are built and on (quant_gemv.use_cuda): the
        same kernel at every row count."""
        from onecat.engine.kernels import quant_gemv

        return (x.numel() <= self.gemv_blocked_rows(x) * self.in_features and x.dtype in (torch.float16, torch.bfloat16)
                and self.scale_zero.dtype in (torch.float16, torch.bfloat16) and self.in_features % 32 == 0
                and quant_gemv.use_cuda() and self.tiles_take(x, self.scale_zero, self.group))

    def _dense(self, x: torch.Tensor) -> torch.Tensor:
        """More rows than the GEMV takes: the library GEMM on a dequantized copy (whole or per row tile)."""
        from onecat.engine.kernels.triton_w4a16 import w4a16_dequant

        tile = self.dense_tile_rows
        words = self.row_major_words()
        if tile <= 0 or tile >= self.out_features:
            w = w4a16_dequant(words, self.scales, self.zeros, self.group, x.dtype)
            return F.linear(x, w, self.bias)
        y = torch.empty(*x.shape[:-1], self.out_features, dtype=x.dtype, device=x.device)
        scratch = torch.empty(tile, self.in_features, dtype=x.dtype, device=x.device)
        for r0 in range(0, self.out_features, tile):
            r1 = min(r0 + tile, self.out_features)
            w = w4a16_dequant(words[r0:r1], self.scales[r0:r1], self.zeros[r0:r1], self.group, x.dtype,
                              out=scratch[:r1 - r0])
            y[..., r0:r1] = F.linear(x, w)
        return y if self.bias is None else y + self.bias
