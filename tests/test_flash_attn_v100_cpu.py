"""FLASH_ATTN_V100 on machines without a GPU: importable, and declines calls with a reason."""
from __future__ import annotations

import pytest
import torch

from onecat.engine.attention.metadata import AttentionMetadata
from onecat.engine.cache.kv import LayerKVCache


def _meta():
    i32 = torch.int32
    return AttentionMetadata(torch.tensor([0, 1], dtype=i32), torch.tensor([1], dtype=i32),
                             torch.zeros(1, 1, dtype=i32), torch.zeros(1, dtype=torch.int64),
                             1, 1, 16, [1], [1], {})


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_cpu_only_call_is_declined_with_reason():
    from onecat.engine.attention.flash_attn_v100 import FlashAttnV100Backend

    q = torch.zeros(1, 4, 64, dtype=torch.float16)
    cache = LayerKVCache(torch.zeros(1, 16, 4, 64, dtype=torch.float16),
                         torch.zeros(1, 16, 4, 64, dtype=torch.float16), None, None, None)
    reason = FlashAttnV100Backend().unsupported_reason(q, cache, _meta())
    assert reason is not None and "CUDA" in reason


def test_import_builds_nothing():
    import onecat.engine.attention.flash_attn_v100 as mod
    from onecat.engine.kernels import flash_attn_v100_ext as ext

    assert mod.FlashAttnV100Backend.name == "FLASH_ATTN_V100"
    assert ext.EXTENSION.module is None or torch.cuda.is_available()


def test_cuda13_on_v100_is_declined_with_reason(monkeypatch):
    from onecat.engine.kernels import flash_attn_v100_ext as ext

    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (7, 0))
    reason = ext.prerequisites_missing()
    assert reason is not None and "CUDA 12" in reason and "sm_70" in reason


def test_decode_variant_switch(monkeypatch):
    from onecat.engine.attention import flash_attn_v100 as mod

    monkeypatch.delenv(mod.DECODE_VARIANT_ENV, raising=False)
    assert mod.FlashAttnV100Backend().decode_variant == "regs"
    monkeypatch.setenv(mod.DECODE_VARIANT_ENV, "smem")
    assert mod.FlashAttnV100Backend().decode_variant == "smem"
    assert mod.FlashAttnV100Backend(decode_variant="regs").decode_variant == "regs"
    monkeypatch.setenv(mod.DECODE_VARIANT_ENV, "fast")
    with pytest.raises(ValueError, match="smem, regs"):
        mod.FlashAttnV100Backend()
    monkeypatch.delenv(mod.DECODE_VARIANT_ENV)
    monkeypatch.delenv(mod.PREFILL_VARIANT_ENV, raising=False)
    assert mod.FlashAttnV100Backend().prefill_variant == "v3"
    monkeypatch.setenv(mod.PREFILL_VARIANT_ENV, "v0")
    assert mod.FlashAttnV100Backend().prefill_variant == "v0"
