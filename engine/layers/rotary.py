"""Rotary position embedding with the checkpoint's theta and scaling (default, linear, llama3, yarn)."""
from __future__ import annotations

import math

import torch
from torch import nn

from onecat.engine.errors import UnsupportedModelError


def _inv_freq(dim: int, base: float) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _llama3(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    factor, low, high = s["factor"], s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
    old_len = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(dim: int, base: float, s: dict, max_pos: int) -> tuple[torch.Tensor, float]:
    factor = s["factor"]
    old_len = s.get("original_max_position_embeddings", max_pos)
    beta_fast, beta_slow = s.get("beta_fast", 32), s.get("beta_slow", 1)

    def corr_dim(rot):
        return (dim * math.log(old_len / (rot * 2 * math.pi))) / (2 * math.log(base))

    low = max(math.floor(corr_dim(beta_fast)), 0)
    high = min(math.ceil(corr_dim(beta_slow)), dim - 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extra, inter = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / max(high - low, 1e-3), 0, 1)
    extra_factor = 1 - ramp
    inv = inter * (1 - extra_factor) + extra * extra_factor
    attn_factor = s.get("attention_factor") or (0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0)
    return inv, attn_factor


class RotaryEmbedding(nn.Module):
    """Precomputes cos/sin for every position once; applies the half-split (NeoX/HF) rotation."""

    def __init__(self, head_dim: int, base: float, max_positions: int, scaling: dict | None):
        super().__init__()
        self.head_dim, self.base, self.max_positions, self.scaling = head_dim, base, max_positions, scaling
        self.build_tables(torch.device("cpu"))

    def build_tables(self, device: torch.device) -> None:
        """(Re)compute the cos/sin tables on `device` (they are derived, never loaded from weights)."""
        head_dim, base, scaling = self.head_dim, self.base, self.scaling
        mscale = 1.0
        kind = (scaling or {}).get("rope_type") or (scaling or {}).get("type") or "default"
        with torch.device("cpu"):
            if kind == "default":
                inv = _inv_freq(head_dim, base)
            elif kind == "linear":
                inv = _inv_freq(head_dim, base) / scaling["factor"]
            elif kind == "llama3":
                inv = _llama3(_inv_freq(head_dim, base), scaling)
            elif kind == "yarn":
                inv, mscale = _yarn(head_dim, base, scaling, self.max_positions)
            else:
                raise UnsupportedModelError(f"rope scaling {kind!r} is not supported; supported: default, "
                                            "linear, llama3, yarn")
            t = torch.arange(self.max_positions, dtype=torch.int64).float()
            emb = torch.cat((torch.outer(t, inv),) * 2, dim=-1)
        self.register_buffer("cos", (emb.cos() * mscale).to(device), persistent=False)
        self.register_buffer("sin", (emb.sin() * mscale).to(device), persistent=False)
        self._cached = None

    @staticmethod
    def _rotate_half(x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    def _step_tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sign-folded sin ([T, 1, D]) at the step's positions. On CPU they are computed once per
        step and shared by its layers (all rotate at the same positions): a step's positions tensor is
        made fresh for it, so the tensor itself is the key. Not on GPUs, where CUDA graphs refill one
        positions buffer in place and replay the lookup."""
        cached = self._cached
        if cached is not None and cached[0] is positions and cached[1] == dtype:
            return cached[2], cached[3]
        half = self.head_dim // 2
        cos = self.cos[positions].unsqueeze(1).to(dtype)
        sin = self.sin[positions].unsqueeze(1).to(dtype)
        signed_sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
        if positions.device.type == "cpu":
            self._cached = (positions, dtype, cos, signed_sin)
        return cos, signed_sin

    def rotate(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The half-split rotation of x: [T, H, D] (q, k, or both side by side). x * cos + rotate_half(x) *
        sin, written as x * cos + roll(x, D/2) * [-sin | sin]: the same products (a sign moved from one
        factor to the other is exact), three ops instead of six."""
        cos, signed_sin = self._step_tables(positions, x.dtype)
        return x * cos + torch.roll(x, self.head_dim // 2, dims=-1) * signed_sin

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q: [T, Hq, D], k: [T, Hkv, D]."""
        return self.rotate(positions, q), self.rotate(positions, k)
