"""A linear layer whose FP8 (E4M3) weight stays packed in GPU memory (engine/quant/fp8/layout.py).

Up to 8 rows (decode steps) run the CUDA packed GEMV (engine/kernels/quant_gemv.py), which decodes each byte
into float32 in registers; more rows, or a machine where that GEMV cannot be built, dequantize the weight into
the activation dtype per call and take the library GEMM (rounding each weight once, as loading the
checkpoint dense would). On CPU the layer runs on the exactly dequantized weight (a reference path).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from onecat.engine.quant.fp8.layout import FP8Weight, codes
from onecat.engine.quant.tiled_words import TiledWords


DENSE_ROWS = 4096  # rows of the weight dequantized at once for the dense path


class FP8Linear(TiledWords, nn.Module):
    """y = x @ W^T + b with W packed E4M3 bytes and a float32 scale per output row."""

    words_format = "fp8"

    def __init__(self, weight: FP8Weight, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = weight.in_features, weight.out_features
        self.register_buffer("qweight", weight.qweight)
        self.register_buffer("scale", weight.scale)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def packed(self) -> FP8Weight:
        return FP8Weight(self.row_major_words(), self.scale)

    def use_tiles(self, act_dtype: torch.dtype) -> None:
        """Keep the words in the tensor-core GEMV's tiles where it takes this layer's calls (tiled_words.py)."""
        self.tile_words(act_dtype, self.scale)

    def gemv_operands(self) -> tuple[str, torch.Tensor, torch.Tensor, int]:
        return "fp8", self.scale, self.scale, 0

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 e4m3"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"FP8Linear takes {self.in_features} input features, got a {tuple(x.shape)} input")
        if x.is_cuda and x.dtype in (torch.float16, torch.bfloat16):
            from onecat.engine.kernels import quant_gemv

            x = x.contiguous()
            if (x.numel() <= self.gemv_blocked_rows(x) * self.in_features and quant_gemv.use_cuda()
                    and self.tiles_take(x, self.scale)):
                fmt, scales, row_scale, _ = self.gemv_operands()
                y = quant_gemv.packed_gemv_blocks(x, fmt, self.qweight, scales, row_scale, tiled=self.tiled)
                return y if self.bias is None else y + self.bias
            y = self.packed_rows(x)
            if y is not None:
                return y
        return F.linear(x, self.dense_weight(x.dtype), self.bias)

    def rows_gemm(self, x: torch.Tensor) -> torch.Tensor:
        from onecat.engine.kernels.triton_packed_rows import fp8_rows_gemm

        return fp8_rows_gemm(x, self.qweight, self.scale, self.tiled)

    def dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight in `dtype` for the library GEMM of more rows than the GEMV takes: fp8.layout.dequantize's
        float32 rounded once. On CUDA one Triton pass (engine/kernels/triton_fp8.py); elsewhere in blocks of
        DENSE_ROWS rows (a bounded float32 temporary, no wider integers)."""
        if self.qweight.is_cuda:
            from onecat.engine.kernels.triton_support import triton_unavailable_reason

            if triton_unavailable_reason() is None:
                from onecat.engine.kernels.triton_fp8 import dequantize

                return dequantize(self.row_major_words(), self.scale, dtype)
        c = codes(self.packed())
        out = torch.empty(c.shape, dtype=dtype, device=c.device)
        for r0 in range(0, c.shape[0], DENSE_ROWS):
            out[r0:r0 + DENSE_ROWS] = (c[r0:r0 + DENSE_ROWS].float() * self.scale[r0:r0 + DENSE_ROWS, None]).to(dtype)
        return out

    def fused_norm_gemv(self, x: torch.Tensor, residual: torch.Tensor, norm, glu: bool):
        """(self(norm(x + residual)), x + residual) in one CUDA kernel (glu: SiLU(gate) * up of it), or None where
        that kernel does not take the call (engine/kernels/quant_gemv.py folded_call)."""
        if self.tiled or x.shape[-1] != self.in_features:
            return None
        from onecat.engine.kernels import quant_gemv

        return quant_gemv.folded_call(self, x, residual, norm, glu, "fp8", self.qweight, self.scale, self.scale)
