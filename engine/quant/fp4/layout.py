"""The packed FP4 layout the CUDA FP4 GEMV reads (NVFP4 and MXFP4), built from the checkpoints' tensors
without changing a value, and its exact dequantization (the reference the kernel is tested against).

A [N, K] weight with blocks of B input columns (16 for NVFP4, 32 for MXFP4) is held as
  qweight int32 [N, K/8]: word w of a block holds the E2M1 codes of columns w + j*B/8 (j = 0..7, the
      W4A16 interleave, so one j's activations are a contiguous run), code j's four bits placed in SLOTS[j]:
      rotating the word left by a slot's rotation and masking puts the code's sign at bit 31 and its
      magnitude bits at 22-24, i.e. the float32 e2m1 * 2^-126 (the GEMV's decode: 20 integer ops per
      word, against 32 for plain nibbles; six codes take one rotate and one mask);
  scales uint8 [N, K/B]: the checkpoint's block-scale bytes (NVFP4 E4M3, MXFP4 E8M0);
  gscale float32 [N]: NVFP4's global scale for each output row (a fused q/k/v keeps each shard's); None
      for MXFP4.
NVFP4: w = e2m1 * float32(e4m3 * global) (the block scale formed in float32 first, as ModelOpt does);
MXFP4: w = e2m1 * 2^(e - 127). Both are exact in float32. 4.5 (MXFP4: 4.25) bits per weight are read.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from onecat.engine.quant.bits import e2m1, fp4_bytes

FP4_BLOCKS = {"nvfp4": 16, "mxfp4": 32}
MAX_E8M0 = 228  # the GEMV decodes an E8M0 scale as 2^(e - 127) * 2^26 (triton_fp4.py): larger e would overflow


@dataclass
class FP4Weight:
    """One linear's packed FP4 weight (see the module docstring)."""

    qweight: torch.Tensor
    scales: torch.Tensor
    gscale: torch.Tensor | None
    fmt: str

    @property
    def block(self) -> int:
        return FP4_BLOCKS[self.fmt]

    @property
    def out_features(self) -> int:
        return self.qweight.shape[0]

    @property
    def in_features(self) -> int:
        return self.qweight.shape[1] * 8

    def to(self, device) -> FP4Weight:
        g = None if self.gscale is None else self.gscale.to(device)
        return FP4Weight(self.qweight.to(device), self.scales.to(device), g, self.fmt)

    def nbytes(self) -> int:
        """Bytes a GEMV streams: codes, block scales (and the per-row global scales)."""
        parts = [self.qweight, self.scales] + ([self.gscale] if self.gscale is not None else [])
        return sum(t.numel() * t.element_size() for t in parts)


# per code j: the (rotation, target bits) groups that decode it; a code bit for target t sits at (t - r) % 32
SLOTS = (((22, (22, 23, 24, 31)),), ((19, (22, 23, 24, 31)),), ((16, (22, 23, 24, 31)),),
         ((12, (22, 23, 31)), (0, (24,))), ((9, (22, 23)), (1, (24, 31))), ((6, (22, 23, 24, 31)),),
         ((2, (22, 23, 24, 31)),), ((28, (22, 23, 24)), (0, (31,))))
TARGET_BIT = {22: 0, 23: 1, 24: 2, 31: 3}  # target bit -> bit of the E2M1 code (m, e0, e1, sign)


def pack_fp4(codes: torch.Tensor, block: int) -> torch.Tensor:
    """[N, K] E2M1 codes 0..15 -> int32 [N, K/8]: interleaved like w4a16.layout.pack_codes, bits in SLOTS."""
    n, k = codes.shape
    gw = block // 8
    c = codes.to(torch.int64).reshape(n, k // block, 8, gw).transpose(2, 3)  # [N, blocks, word, code j]
    words = torch.zeros(c.shape[:-1], dtype=torch.int64, device=codes.device)
    for j, groups in enumerate(SLOTS):
        for r, targets in groups:
            for t in targets:
                words |= ((c[..., j] >> TARGET_BIT[t]) & 1) << ((t - r) % 32)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32).reshape(n, k // 8)


def unpack_fp4(qweight: torch.Tensor, block: int) -> torch.Tensor:
    """int32 [N, K/8] from pack_fp4 -> [N, K] int32 codes in column order."""
    n, kw = qweight.shape
    gw = block // 8
    w = qweight.to(torch.int64) & 0xFFFFFFFF
    codes = []
    for groups in SLOTS:
        c = torch.zeros_like(w)
        for r, targets in groups:
            for t in targets:
                c |= ((w >> ((t - r) % 32)) & 1) << TARGET_BIT[t]
        codes.append(c)
    q = torch.stack(codes, dim=-1).reshape(n, kw // gw, gw, 8)  # [N, blocks, word, code j]
    return q.transpose(2, 3).reshape(n, kw * 8).to(torch.int32)


def from_nvfp4(weight: torch.Tensor, weight_scale: torch.Tensor, weight_scale_2: torch.Tensor) -> FP4Weight:
    """ModelOpt NVFP4: weight uint8 [N, K/2] (element 2i in the low nibble), weight_scale float8_e4m3fn
    [N, K/16], weight_scale_2 one float32."""
    n, k = weight.shape[0], weight.shape[1] * 2
    if weight.dtype != torch.uint8 or weight_scale.dtype != torch.float8_e4m3fn or weight_scale.shape != (n, k // 16):
        raise ValueError(f"NVFP4 weight {tuple(weight.shape)} {weight.dtype} with weight_scale "
                         f"{tuple(weight_scale.shape)} {weight_scale.dtype}: expected uint8 [N, K/2] and "
                         "float8_e4m3fn [N, K/16]")
    if weight_scale_2.numel() != 1:
        raise ValueError(f"NVFP4 weight_scale_2 has {weight_scale_2.numel()} values; expected one")
    codes = fp4_bytes(weight).to(torch.int32)
    gscale = weight_scale_2.float().reshape(1).expand(n).contiguous()
    return FP4Weight(pack_fp4(codes, 16), weight_scale.view(torch.uint8).contiguous(), gscale, "nvfp4")


def from_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> FP4Weight:
    """MXFP4: blocks uint8 [N, K/32, 16] (element 2i in the low nibble), scales uint8 E8M0 [N, K/32]."""
    if blocks.dtype != torch.uint8 or blocks.dim() != 3 or blocks.shape[-1] != 16 or scales.shape != blocks.shape[:2]:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} {blocks.dtype} with scales {tuple(scales.shape)}: "
                         "expected uint8 [N, K/32, 16] and uint8 [N, K/32]")
    codes = fp4_bytes(blocks).flatten(1).to(torch.int32)
    return FP4Weight(pack_fp4(codes, 32), scales.to(torch.uint8).contiguous(), None, "mxfp4")


def block_scales(w: FP4Weight) -> torch.Tensor:
    """float32 [N, K/B]: each block's scale as the reference forms it."""
    if w.fmt == "nvfp4":
        return w.scales.view(torch.float8_e4m3fn).float() * w.gscale[:, None]
    e = w.scales.to(torch.int32)
    scale = torch.ldexp(torch.ones(e.shape, dtype=torch.float32, device=e.device), e - 127)
    return torch.where(e == 255, torch.tensor(float("nan"), device=e.device), scale)


def dequantize(w: FP4Weight) -> torch.Tensor:
    """The exact float32 [N, K] weight."""
    values = e2m1(unpack_fp4(w.qweight, w.block).cpu()).to(w.qweight.device)
    return values * block_scales(w).repeat_interleave(w.block, dim=1)


def cat_fp4(shards: list[FP4Weight]) -> FP4Weight | None:
    """Fused shards stacked along N (None when their formats or widths differ)."""
    first = shards[0]
    if any(s.fmt != first.fmt or s.in_features != first.in_features for s in shards):
        return None
    g = None if first.gscale is None else torch.cat([s.gscale for s in shards])
    return FP4Weight(torch.cat([s.qweight for s in shards]), torch.cat([s.scales for s in shards]), g, first.fmt)
