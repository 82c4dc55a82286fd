"""Packed linears whose words may be kept in the tensor-core GEMV's tiles (engine/kernels/quant_gemv.py
mma_tiles): where that GEMV takes every 1-8-row call of the layer, a warp then reads 512 contiguous bytes a load
instead of 64 from each of 8 rows (the same bits, measured faster on an H200). Every other reader of the words
(the dense path of prefill, the Triton and folded GEMVs, `packed()`) takes them row-major (row_major_words).
"""
from __future__ import annotations

import torch


class TiledWords:
    """Mixin of W4A16Linear, FP4Linear and FP8Linear: `qweight` row-major, or in tiles when `tiled`."""

    tiled = False
    words_format = ""  # the quant_gemv format name of the words ("int4", "nvfp4", "mxfp4", "fp8")

    def tile_words(self, act_dtype: torch.dtype, scales: torch.Tensor, group: int = 0) -> None:
        """Re-lay qweight in tiles if the tensor-core GEMV takes this layer's calls at `act_dtype`."""
        from onecat.engine.kernels import quant_gemv

        if self.tiled or not quant_gemv.tiles_apply(self.words_format, act_dtype, scales, group,
                                                    self.qweight.shape[0], self.in_features):
            return
        self.qweight = quant_gemv.mma_tiles(self.qweight, self.words_format)
        self.tiled = True

    def row_major_words(self) -> torch.Tensor:
        if not self.tiled:
            return self.qweight
        from onecat.engine.kernels.quant_gemv import mma_untile

        return mma_untile(self.qweight, self.words_format)

    def tiles_take(self, x: torch.Tensor, scales: torch.Tensor, group: int = 0) -> bool:
        """Whether a 1-8-row call may run on the words as they are: row-major, or tiles the tensor-core GEMV takes."""
        if not self.tiled:
            return True
        from onecat.engine.kernels.quant_gemv import tensor_cores_apply

        return tensor_cores_apply(x, self.words_format, scales, group, False)
