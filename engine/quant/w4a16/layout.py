"""The packed 4-bit layout the CUDA W4A16 kernels read, its exact dequantization, and a round-to-nearest
quantizer for dense weights.

A [N, K] weight with groups of G input columns (G = 32, 64 or 128) is held as
  qweight int32 [N, K/8]: within each group, word w (of G/8) holds the columns w + j*G/8 for j = 0..7,
      column w + j*G/8 in nibble j (bits 4j..4j+3). For one j, consecutive words then hold consecutive
      columns, so the GEMV loads the activations of a nibble as one contiguous run and every word's eight
      nibbles share one scale and zero;
  scales [N, K/G] in the checkpoint's float dtype (fp16 for the quantizer), zeros fp16 [N, K/G] (whole
      numbers 0..16: an fp16 holds them exactly, and the kernel subtracts them in fp32);
  perm int32 [K] or None: the layer's input column held at stored column c (act-order checkpoints store
      their groups scattered over K; sorting the columns by group makes each group one run).
w[n, perm[c]] = (q[n, c] - z[n, c/G]) * s[n, c/G]: an integer times the scale, exact in float32 for
half-precision scales.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

GROUPS = (32, 64, 128)  # group sizes the kernels take; a larger multiple of 128 is repeated down to 128


@dataclass
class W4A16Weight:
    """One linear's packed 4-bit weight (see the module docstring for the layout)."""

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    group: int
    perm: torch.Tensor | None = None

    @property
    def out_features(self) -> int:
        return self.qweight.shape[0]

    @property
    def in_features(self) -> int:
        return self.qweight.shape[1] * 8

    def to(self, device) -> W4A16Weight:
        perm = None if self.perm is None else self.perm.to(device)
        return W4A16Weight(self.qweight.to(device), self.scales.to(device), self.zeros.to(device), self.group, perm)

    def nbytes(self) -> int:
        """Bytes a GEMV streams for this weight: codes, scales and zeros."""
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.scales, self.zeros))


def pack_codes(q: torch.Tensor, group: int) -> torch.Tensor:
    """[N, K] integer codes 0..15 -> int32 [N, K/8] in the interleaved layout."""
    n, k = q.shape
    gw = group // 8
    q = q.to(torch.int64).reshape(n, k // group, 8, gw).transpose(2, 3)  # [N, groups, word, nibble]
    words = (q << torch.arange(0, 32, 4, dtype=torch.int64, device=q.device)).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32).reshape(n, k // 8)


def unpack_codes(qweight: torch.Tensor, group: int) -> torch.Tensor:
    """int32 [N, K/8] in the interleaved layout -> [N, K] int32 codes 0..15 in stored column order."""
    n, kw = qweight.shape
    gw = group // 8
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=qweight.device)
    q = (qweight.reshape(n, kw // gw, gw, 1) >> shifts) & 0xF  # [N, groups, word, nibble]
    return q.transpose(2, 3).reshape(n, kw * 8)


def scale_zero_pairs(scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """[N, K/G, 2]: each group's (scale, zero) side by side in the scales' dtype (zeros are whole numbers
    0..16, exact in any of them), the form the GEMVs read."""
    return torch.stack([scales, zeros.to(scales.dtype)], dim=-1).contiguous()


def dequantize(w: W4A16Weight) -> torch.Tensor:
    """The dense [N, K] float32 weight in the layer's input order (exact for half-precision scales)."""
    q = unpack_codes(w.qweight, w.group).float()
    z = w.zeros.float().repeat_interleave(w.group, dim=1)
    s = w.scales.float().repeat_interleave(w.group, dim=1)
    dense = (q - z) * s
    if w.perm is None:
        return dense
    out = torch.empty_like(dense)
    out[:, w.perm.long()] = dense
    return out


def from_codes(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, perm: torch.Tensor | None = None,
               what: str = "weight") -> W4A16Weight:
    """Packs [N, K] codes with [N, K/G] scales and zeros (codes, zeros as unsigned 4-bit numbers, columns in
    stored order). A group of a larger multiple of 128 (per-channel scales included) is stored as groups of
    128 with repeated scales."""
    n, k = q.shape
    groups = scales.shape[1]
    if scales.shape != (n, groups) or zeros.shape != (n, groups) or groups == 0 or k % groups:
        raise ValueError(f"{what}: codes {tuple(q.shape)}, scales {tuple(scales.shape)} and zeros "
                         f"{tuple(zeros.shape)} are not [N, K], [N, K/G], [N, K/G]")
    group = k // groups
    if group not in GROUPS:
        if group % 128:
            raise ValueError(f"{what}: group size {group} (K={k}) is not supported by the W4A16 kernels: they take "
                             f"groups of {', '.join(map(str, GROUPS))} or multiples of 128; load the checkpoint "
                             "without the w4a16 quantization (dequantized) instead")
        scales, zeros = (t.repeat_interleave(group // 128, dim=1) for t in (scales, zeros))
        group = 128
    if int(q.min()) < 0 or int(q.max()) > 15:
        raise ValueError(f"{what}: codes outside 0..15")
    if scales.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        scales = scales.float()
    p = None if perm is None else perm.to(torch.int32).contiguous()
    return W4A16Weight(pack_codes(q, group), scales.contiguous(), zeros.to(torch.float16).contiguous(), group, p)


def quantize_w4(weight: torch.Tensor, group: int = 128) -> W4A16Weight:
    """Round-to-nearest asymmetric 4-bit quantization of a dense [N, K] weight, min-max per group of `group`
    input columns, fp16 scales: for benchmarks and for dense checkpoints quantized on load (no calibration,
    so expect a larger quality loss than AWQ or GPTQ)."""
    if group not in GROUPS:
        raise ValueError(f"quantize_w4: group {group} is not one of {GROUPS}")
    n, k = weight.shape
    if k % group:
        raise ValueError(f"quantize_w4: in_features {k} is not a multiple of the group size {group}")
    g = weight.float().reshape(n, k // group, group)
    lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
    scales = ((hi - lo) / 15).clamp(min=2**-14).half()
    s = scales.float()
    zeros = (-lo / s).round().clamp(0, 15)
    q = (g / s.unsqueeze(-1) + zeros.unsqueeze(-1)).round().clamp(0, 15).to(torch.int32).reshape(n, k)
    return W4A16Weight(pack_codes(q, group), scales.contiguous(), zeros.half().contiguous(), group)


def cat_w4a16(shards: list[W4A16Weight]) -> W4A16Weight | None:
    """The shards of a fused projection stacked along N (None when their groups or permutations differ)."""
    first = shards[0]
    for w in shards[1:]:
        same_perm = (w.perm is None and first.perm is None) or (
            w.perm is not None and first.perm is not None and torch.equal(w.perm, first.perm))
        if w.group != first.group or w.in_features != first.in_features or not same_perm \
                or w.scales.dtype != first.scales.dtype:
            return None
    return W4A16Weight(torch.cat([w.qweight for w in shards]), torch.cat([w.scales for w in shards]),
                       torch.cat([w.zeros for w in shards]), first.group, first.perm)
