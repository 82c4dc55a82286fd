"""Packed linears whose words may be kept in the tensor-core GEMV's tiles (engine/kernels/quant_gemv.py
mma_tiles): where that GEMV takes every 1-8-row call of the layer, a warp then reads 512 contiguous bytes a load
instead of 64 from each of 8 rows (the same bits, measured faster on an H200). Every other reader of the words
(the dense path of prefill, the Triton and folded GEMVs, `packed()`) takes them row-major (row_major_words).
FP4 also moves its codes into the activation dtype's slots (FP4Linear's code-slot methods, fp4/slots.py), which
that GEMV decodes in half the instructions.
"""
from __future__ import annotations

import torch


class TiledWords:
    """Mixin of W4A16Linear, FP4Linear and FP8Linear: `qweight` row-major, or in tiles when `tiled` (the layout,
    quant_gemv.TILED, TILED_FP16_SLOTS or TILED_BF16_SLOTS)."""

    tiled = 0
    words_format = ""  # the quant_gemv format name of the words ("int4", "nvfp4", "mxfp4", "fp8")

    def tile_words(self, act_dtype: torch.dtype, scales: torch.Tensor, group: int = 0) -> None:
        """Re-lay qweight in tiles if the tensor-core GEMV takes this layer's calls at `act_dtype`."""
        from onecat.engine.kernels import quant_gemv

        if self.tiled or not quant_gemv.tiles_apply(self.words_format, act_dtype, scales, group,
                                                    self.qweight.shape[0], self.in_features):
            return
        layout = quant_gemv.mma_layout(self.words_format, act_dtype, scales)
        words = self.qweight
        if layout in quant_gemv.SLOT_DTYPES:
            words = self.to_code_slots(words, quant_gemv.SLOT_DTYPES[layout])
        self.qweight = quant_gemv.mma_tiles(words, self.words_format)
        self.tiled = layout

    def untiled_words(self) -> tuple[torch.Tensor, torch.dtype | None]:
        """(the words in row order, the activation dtype whose code slots they are in, or None): a cheap copy,
        for readers that decode the slots themselves (the FP4 prefill dequantizer)."""
        if not self.tiled:
            return self.qweight, None
        from onecat.engine.kernels import quant_gemv

        return quant_gemv.mma_untile(self.qweight, self.words_format), quant_gemv.SLOT_DTYPES.get(self.tiled)

    def row_major_words(self) -> torch.Tensor:
        """The words in the format's own layout (engine/quant/*/layout.py)."""
        words, slots = self.untiled_words()
        if slots is not None:
            words = self.from_code_slots(words, slots)
        return words

    def to_code_slots(self, words: torch.Tensor, act_dtype: torch.dtype) -> torch.Tensor:
        """Row-major words -> the same words in act_dtype's code slots (mma_layout gives slots to FP4 only)."""
        raise NotImplementedError(f"{self.words_format} words have no code slots")

    def from_code_slots(self, words: torch.Tensor, act_dtype: torch.dtype) -> torch.Tensor:
        """The inverse of to_code_slots."""
        raise NotImplementedError(f"{self.words_format} words have no code slots")

    def tiles_take(self, x: torch.Tensor, scales: torch.Tensor, group: int = 0) -> bool:
        """Whether a 1-8-row call may run on the words as they are: row-major, or tiles the tensor-core GEMV takes."""
        if not self.tiled:
            return True
        from onecat.engine.kernels.quant_gemv import layout_takes, tensor_cores_apply

        return (tensor_cores_apply(x, self.words_format, scales, group, False)
                and layout_takes(self.tiled, self.words_format, x.dtype))

    def packed_rows(self, x: torch.Tensor) -> torch.Tensor | None:
        """x @ W^T (+ bias) by the packed many-row GEMM where it takes this call (triton_support.packed_rows_take:
        its rows for this format, ONECAT_PACKED_ROWS_GEMM), reading the words as they lie; None otherwise."""
        from onecat.engine.kernels.triton_support import packed_rows_take

        if not packed_rows_take(x, self.in_features, x.numel() // self.in_features, self.words_format):
            return None
        y = self.rows_gemm(x)
        bias = getattr(self, "bias", None)
        return y if bias is None else y + bias

    def rows_gemm(self, x: torch.Tensor) -> torch.Tensor:
        """This format's call of engine/kernels/triton_packed_rows.py on the words as they lie."""
        raise NotImplementedError

    def gemv_blocked_rows(self, x: torch.Tensor) -> int:
        """The most rows of x's call this layer sends to the packed GEMV (quant_gemv.blocked_rows at the rows one
        of its calls takes here)."""
        from onecat.engine.kernels import quant_gemv

        if x.numel() > quant_gemv.BLOCKED_ROWS * self.in_features:  # a prefill's rows: no GEMV call list takes them
            return quant_gemv.BLOCKED_ROWS
        fmt, scales, _, group = self.gemv_operands()
        return quant_gemv.blocked_rows(self.words_format, quant_gemv.rows_per_call(x, fmt, scales, group))

    def gemv_operands(self) -> tuple[str, torch.Tensor, torch.Tensor | None, int]:
        """(format, scales, row scale, group) of this layer's packed_gemv calls."""
        raise NotImplementedError

    def glu_gemv(self, x: torch.Tensor) -> torch.Tensor | None:
        """SiLU(gate) * up of this [gate | up] layer's output for 1-8 rows (1-16 with quant_gemv.MMA_16_ROWS), in the
        tensor-core GEMV's epilogue: one kernel where the projection and the SiLU * mul kernel took two, the same
        bits. None where that GEMV does not take the call (words not in its tiles, a bias, W4A16 act-order, halves
        not a multiple of 16 rows)."""
        from onecat.engine.kernels import quant_gemv

        if (not quant_gemv.GLU_IN_GEMV or not self.tiled or not x.is_cuda or getattr(self, "bias", None) is not None
                or getattr(self, "perm", None) is not None or x.shape[-1] != self.in_features
                or self.out_features % 32 or not quant_gemv.use_cuda()):
            return None
        fmt, scales, row_scale, group = self.gemv_operands()
        if not self.tiles_take(x, scales, group) or x.numel() > quant_gemv.rows_per_call(x, fmt, scales, group) * \
                self.in_features:
            return None
        return quant_gemv.packed_gemv(x.contiguous(), fmt, self.qweight, scales, row_scale, group, glu=True,
                                      tiled=self.tiled)
