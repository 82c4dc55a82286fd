"""A linear layer whose NVFP4 / MXFP4 weight stays packed in GPU memory (engine/quant/fp4/layout.py).

Up to 32 rows (decode and verify steps) run the CUDA packed GEMV (engine/kernels/quant_gemv.py, 8 rows a
call; one kernel at every row count, so batch-invariant), or, up to 8 rows, the FP4 GEMV of
engine/kernels/triton_fp4.py where the CUDA one cannot be built or ONECAT_QUANT_GEMV=triton; both decode the
codes and block scales in registers (plain FMAs: it runs on SM70 too); at 2-8 rows on SM80+ the tile is
decoded and multiplied on the tensor cores instead (engine/kernels/triton_fp4_dot.py). 33-128 rows (verify
steps at batch > 2, larger decode batches; ONECAT_PACKED_ROWS_GEMM=0 turns it off) decode the words as they lie
and multiply on the tensor cores (engine/kernels/triton_packed_rows.py: the weight read once, packed). More rows
(prefill) dequantize the weight into the activation dtype per call (a Triton kernel, engine/kernels/triton_fp4.py)
and take the library GEMM (rounding each weight once, as loading the checkpoint dense would). On CPU the layer
runs on the exactly dequantized weight.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from onecat.engine.quant.bits import E2M1_VALUES
from onecat.engine.quant.fp4.layout import FP4Weight, block_scales, dequantize, unpack_fp4
from onecat.engine.quant.fp4.slots import from_slots, to_slots
from onecat.engine.quant.tiled_words import TiledWords

MAX_ROWS = 8
FMT_IDS = {"nvfp4": 0, "mxfp4": 1}  # triton_fp4.NVFP4 / MXFP4


def default_config(n: int, k: int, m: int, block: int, sm: int | None = None) -> tuple:
    """(BLOCK_N, BLOCK_KW, num_warps, SPLIT) for the FMA GEMV, or ("dot", BLOCK_N, num_warps, num_stages,
    SPLIT) for the tensor-core path (2-8 rows, SM80+, K a multiple of 128). From the H200 sweep of the 8B
    projections (benchmarks/results/quant_h200.json, "fp4"): one row, 8 rows of 2 warps with K split in two
    was the best or within 10% of it on 7 of the 8 shape/format pairs; 2-8 rows, 32-row tensor-core tiles
    with K split in two were the best on 5 of 8 (FMA 4-row tiles below SM80)."""
    kw = k // 8
    if m > 1 and sm is not None and sm >= 80 and k % 128 == 0:
        return ("dot", 32, 4, 3, 2 if k % 256 == 0 else 1)
    bkw = 128
    while kw % bkw or bkw % (block // 8):
        bkw //= 2
    if m > 1:
        return 4, bkw, 2, 1
    return 8, bkw, 2, 2 if kw % (2 * bkw) == 0 else 1


class FP4Linear(TiledWords, nn.Module):
    """y = x @ W^T + b with W packed FP4 (codes, block-scale bytes, NVFP4's per-row global scale)."""

    def __init__(self, weight: FP4Weight, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features, self.fmt = weight.in_features, weight.out_features, weight.fmt
        self.words_format = weight.fmt
        self.register_buffer("qweight", weight.qweight)
        self.register_buffer("scales", weight.scales)
        self.register_buffer("gscale", weight.gscale if weight.gscale is not None
                             else torch.ones(weight.out_features, device=weight.qweight.device))
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def packed(self) -> FP4Weight:
        return FP4Weight(self.row_major_words(), self.scales, self.gscale if self.fmt == "nvfp4" else None, self.fmt)

    def use_tiles(self, act_dtype: torch.dtype) -> None:
        """Keep the words in the tensor-core GEMV's tiles where it takes this layer's calls (tiled_words.py)."""
        self.tile_words(act_dtype, self.scales)

    def to_code_slots(self, words: torch.Tensor, act_dtype: torch.dtype) -> torch.Tensor:
        return to_slots(words, act_dtype, self.words_format)

    def from_code_slots(self, words: torch.Tensor, act_dtype: torch.dtype) -> torch.Tensor:
        return from_slots(words, act_dtype, self.words_format)

    def gemv_operands(self) -> tuple[str, torch.Tensor, torch.Tensor | None, int]:
        return self.fmt, self.scales, self.gscale if self.fmt == "nvfp4" else None, 0

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.fmt}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"FP4Linear takes {self.in_features} input features, got a {tuple(x.shape)} input")
        if not x.is_cuda:
            return F.linear(x, dequantize(self.packed()).to(x.dtype), self.bias)
        x = x.contiguous()
        m = x.numel() // self.in_features
        from onecat.engine.kernels import quant_gemv

        if m <= self.gemv_blocked_rows(x) and x.dtype in (torch.float16, torch.bfloat16) and \
                self.tiles_take(x, self.scales):
            if quant_gemv.use_cuda() and self.in_features % 32 == 0:
                fmt, scales, row_scale, _ = self.gemv_operands()
                y = quant_gemv.packed_gemv_blocks(x, fmt, self.qweight, scales, row_scale, tiled=self.tiled)
                return y if self.bias is None else y + self.bias
            if m <= MAX_ROWS:
                y = fp4_gemv(x, self.packed())
                return y if self.bias is None else y + self.bias
        y = self.packed_rows(x)
        return y if y is not None else F.linear(x, self.dense_weight(x.dtype), self.bias)

    def rows_gemm(self, x: torch.Tensor) -> torch.Tensor:
        from onecat.engine.kernels import quant_gemv, triton_packed_rows

        return triton_packed_rows.fp4_rows_gemm(x, self.qweight, self.scales, self.gscale, FMT_IDS[self.fmt],
                                                tiled=self.tiled, slots=quant_gemv.SLOT_DTYPES.get(self.tiled))

    def dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The dense CUDA weight for the library GEMM of a prefill, from the Triton dequantizer (each weight
        rounded once, the bits of dense_on_device, about as fast as writing the dense weight)."""
        from onecat.engine.kernels import triton_fp4 as kf

        words, slots = self.untiled_words()
        return kf.dequantize(words, self.scales, self.gscale, FMT_IDS[self.fmt], dtype, slots=slots)

    def fused_norm_gemv(self, x: torch.Tensor, residual: torch.Tensor, norm, glu: bool):
        """(self(norm(x + residual)), x + residual) in one CUDA kernel (glu: SiLU(gate) * up of it), or None where
        that kernel does not take the call (engine/kernels/quant_gemv.py folded_call)."""
        if self.tiled or x.shape[-1] != self.in_features:
            return None
        from onecat.engine.kernels import quant_gemv

        return quant_gemv.folded_call(self, x, residual, norm, glu, self.fmt, self.qweight, self.scales,
                                      self.gscale if self.fmt == "nvfp4" else None)


def fp4_gemv(x: torch.Tensor, w: FP4Weight, config: tuple | None = None) -> torch.Tensor:
    """y = x @ dequant(W)^T for a contiguous fp16/bf16 CUDA x of at most MAX_ROWS rows."""
    from onecat.engine.kernels import triton_fp4 as kf
    from onecat.engine.kernels.device import capability
    from onecat.engine.kernels.triton_w4a16 import split_sum

    n, k = w.out_features, w.in_features
    m = x.numel() // k
    if m > MAX_ROWS or x.shape[-1] != k or not x.is_contiguous():
        raise ValueError(f"fp4_gemv takes a contiguous input of {k} features and at most {MAX_ROWS} rows, "
                         f"got {tuple(x.shape)}")
    config = config or default_config(n, k, m, w.block, capability(x.device.index if x.device.index is not None
                                                                   else torch.cuda.current_device()))
    y = torch.empty(*x.shape[:-1], n, dtype=x.dtype, device=x.device)
    g = w.gscale if w.gscale is not None else w.scales  # MXFP4 ignores it
    if config[0] == "dot":
        from onecat.engine.kernels import triton_fp4_dot as kd

        _, block_n, warps, stages, split = config
        if k % (128 * split) or block_n < 16:
            raise ValueError(f"the FP4 tensor-core path needs K ({k}) a multiple of 128 * SPLIT ({split}) and "
                             f"BLOCK_N ({block_n}) >= 16")
        out = y if split == 1 else torch.empty(split, m, n, dtype=torch.float32, device=x.device)
        kd.launch(x, w.qweight, w.scales, g, out, FMT_IDS[w.fmt], block_n, warps, stages, split)
        return y if split == 1 else split_sum(out, y, m * n, split)
    block_n, block_kw, warps, split = config
    if (k // 8) % (block_kw * split) or block_kw % (w.block // 8):
        raise ValueError(f"BLOCK_KW {block_kw} times SPLIT {split} must divide the row's {k // 8} words and hold "
                         f"whole blocks of {w.block // 8}")
    out = y if split == 1 else torch.empty(split, m, n, dtype=torch.float32, device=x.device)
    kf.launch(x, w.qweight, w.scales, g, out, FMT_IDS[w.fmt], block_n, block_kw, warps, split)
    return y if split == 1 else split_sum(out, y, m * n, split)


def dense_on_device(w: FP4Weight, dtype: torch.dtype) -> torch.Tensor:
    """The dense [N, K] weight in `dtype`, computed where the weight lives (each weight rounded once)."""
    table = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float32, device=w.qweight.device)
    codes = unpack_fp4(w.qweight, w.block)
    return (table[codes.long()] * block_scales(w).repeat_interleave(w.block, dim=1)).to(dtype)
