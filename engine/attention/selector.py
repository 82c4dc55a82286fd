"""Chooses the attention backend, checks each call's capability, falls back, and reports what ran."""
from __future__ import annotations

from collections import Counter

import torch

from onecat.engine.attention.backend import AttentionBackend
from onecat.engine.attention.metadata import AttentionMetadata
from onecat.engine.attention.torch_ref import TorchReferenceBackend
from onecat.engine.cache.kv import LayerKVCache
from onecat.engine.errors import ConfigError

BACKEND_NAMES = ("auto", "TORCH_SDPA_REF", "CPU_PAGED", "FLASH_ATTN_V100", "TRITON_PAGED")


def _make(name: str, prompt_tiles: bool) -> AttentionBackend:
    if name == "TORCH_SDPA_REF":
        return TorchReferenceBackend()
    if name == "CPU_PAGED":
        from onecat.engine.attention.cpu_paged import CpuPagedBackend

        return CpuPagedBackend(prompt_tiles)
    if name == "FLASH_ATTN_V100":
        from onecat.engine.attention.flash_attn_v100 import FlashAttnV100Backend

        return FlashAttnV100Backend()
    if name == "TRITON_PAGED":
        from onecat.engine.attention.triton_paged import TritonPagedBackend

        return TritonPagedBackend()
    raise ConfigError(f"unknown attention backend {name!r}; choose one of {', '.join(BACKEND_NAMES)}")


def choose_backend_name(requested: str, device: torch.device) -> str:
    if requested not in BACKEND_NAMES:
        raise ConfigError(f"unknown attention backend {requested!r}; choose one of {', '.join(BACKEND_NAMES)}")
    if requested != "auto":
        return requested
    if device.type == "cuda" and torch.cuda.get_device_capability(device) == (7, 0):
        return "FLASH_ATTN_V100"
    if device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 0):
        return "TRITON_PAGED"
    if device.type == "cpu":
        return "CPU_PAGED"
    return "TORCH_SDPA_REF"


class AttentionDispatcher:
    """Callable used by every attention layer; counts which backend actually served each call."""

    def __init__(self, requested: str, device: torch.device, prompt_tiles: bool = False):
        """`prompt_tiles`: EngineArgs.cpu_prompt_matmul "bf16" (prompt rows on AMX tiles, CPU_PAGED)."""
        self.requested = requested
        self.primary_name = choose_backend_name(requested, device)
        self.reference = TorchReferenceBackend()
        try:
            self.primary = _make(self.primary_name, prompt_tiles)
            self.load_error = None
        except Exception as e:  # a backend that cannot even be constructed (no extension) falls back
            self.primary, self.load_error = self.reference, f"{self.primary_name} unavailable: {e}"
        self.calls: Counter[str] = Counter()
        self.fallback_reasons: Counter[str] = Counter()

    def __call__(self, q: torch.Tensor, cache: LayerKVCache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        backend = self.primary
        if backend is not self.reference:
            reason = backend.unsupported_reason(q, cache, meta)
            if reason is not None:
                self.fallback_reasons[reason] += 1
                backend = self.reference
        self.calls[backend.name] += 1
        return backend.forward(q, cache, meta, scale)

    def takes_new_tokens(self, q: torch.Tensor, cache: LayerKVCache, meta: AttentionMetadata) -> bool:
        """Whether the chosen backend's own kernel also norms, rotates and stores this step's new tokens (then call
        with_new_tokens; else rotate and store first, and call this dispatcher as usual). The backend's cheap check
        comes first: with it off, no call pays for a second capability check."""
        takes = getattr(self.primary, "takes_new_tokens", None)
        return (takes is not None and takes(cache, meta)
                and self.primary.unsupported_reason(q, cache, meta) is None)

    def with_new_tokens(self, q: torch.Tensor, new, cache: LayerKVCache, meta: AttentionMetadata,
                        scale: float) -> torch.Tensor:
        """Attention that also norms, rotates and stores the step's new tokens (`new`: what the qkv projection left,
        q unrotated), where takes_new_tokens said so."""
        self.calls[self.primary.name] += 1
        return self.primary.forward_new_tokens(q, new, cache, meta, scale)

    def runs_cpu_paged(self) -> bool:
        """Whether attention is the C++ CPU paged kernel (chosen and built), which the one-call decode step runs."""
        return self.primary.name == "CPU_PAGED"

    def count_calls(self, n: int) -> None:
        """Calls of the primary backend made outside __call__ (the one-call CPU decode step)."""
        self.calls[self.primary.name] += n

    def report(self) -> dict:
        """The effective path: what served the calls so far, and why anything fell back."""
        effective = self.calls.most_common(1)[0][0] if self.calls else self.primary.name
        return {"requested": self.requested, "selected": self.primary_name, "effective": effective,
                "calls": dict(self.calls), "fallback_reasons": dict(self.fallback_reasons),
                "load_error": self.load_error, "prompt_rows_on_tiles": getattr(self.primary, "prompt_tiles", False),
                "calls_with_prompt_rows_on_tiles": getattr(self.primary, "tile_calls", 0)}
