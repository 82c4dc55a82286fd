"""CPU attention in C++ (csrc/cpu/paged_attention.cpp) that reads the paged cache in place.

One job per (query token, KV head), keys walked in fixed chunks from position 0 with an online softmax,
so a token's result depends on its query and its keys alone: the same in any batch, at any query length,
with or without a prefix-cache hit (the CPU batch invariance the reference's fixed tiles give, without
their padding rows, masks and gather copies). It is the CPU's default attention where the C++ ops build;
TORCH_SDPA_REF stays the reference.
"""
from __future__ import annotations

import torch

from onecat.engine.attention.backend import AttentionBackend
from onecat.engine.attention.metadata import AttentionMetadata
from onecat.engine.cache.kv import LayerKVCache

FP8_KINDS = {None: 0, torch.float8_e4m3fn: 1, torch.float8_e5m2: 2}  # paged_attention.cpp's fp8_kind
_VECTOR = 16  # head dims a multiple of this run on every vector width the ops are built for
MAX_HEAD_DIM, MAX_GROUP = 256, 16


class CpuPagedBackend(AttentionBackend):
    name = "CPU_PAGED"

    def __init__(self, prompt_tiles: bool = False):
        """`prompt_tiles` (EngineArgs.cpu_prompt_matmul "bf16"): a step's prompt rows attend on AMX bfloat16 tiles
        (csrc/cpu/amx_attention.cpp) where the cache is bfloat16 and the head dim a multiple of 32; their bits
        then differ from the float32 kernel's, which every other row keeps."""
        from onecat.engine.kernels import cpu_ops

        self.ops = cpu_ops.load()  # RuntimeError saying why when the ops cannot be built
        self.prompt_tiles = prompt_tiles and bool(self.ops.amx_bf16_isa())
        self.tile_calls = 0  # calls whose prompt rows ran on the tiles (info: a float32 cache never does)

    def unsupported_reason(self, q: torch.Tensor, cache: LayerKVCache, meta: AttentionMetadata) -> str | None:
        if q.device.type != "cpu":
            return "CPU_PAGED runs on the CPU"
        if q.dtype not in (torch.float32, torch.bfloat16):
            return f"CPU_PAGED takes float32 or bfloat16 queries, not {q.dtype}"
        dim, group = q.shape[-1], q.shape[1] // cache.k.shape[2]
        if dim % _VECTOR or dim > MAX_HEAD_DIM or group > MAX_GROUP:
            return f"CPU_PAGED needs head dim a multiple of {_VECTOR} up to {MAX_HEAD_DIM} and <= {MAX_GROUP} query heads per KV head"
        if cache.fp8_dtype not in FP8_KINDS:
            return f"CPU_PAGED does not read {cache.fp8_dtype} caches"
        return None

    def forward(self, q: torch.Tensor, cache: LayerKVCache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        tiles = self.tile_rows(q, cache, meta) if self.prompt_tiles else None
        self.tile_calls += tiles is not None
        return self.ops.paged_attention(q, cache.k, cache.v, cache.k_scale, cache.v_scale, FP8_KINDS[cache.fp8_dtype],
                                        meta.block_tables, meta.query_start_loc, meta.seq_lens, scale, tiles)

    def tile_rows(self, q: torch.Tensor, cache: LayerKVCache, meta: AttentionMetadata) -> torch.Tensor | None:
        """Each sequence's prompt rows in this step (its leading query rows), for the AMX tiles; None where the
        step has none or the tiles cannot read this cache. Made once a step, kept in the metadata's extras."""
        if cache.k.dtype != torch.bfloat16 or q.shape[-1] % 32 or not any(meta.prompt_lens_cpu or ()):
            return None
        if "tile_rows" not in meta.extras:
            meta.extras["tile_rows"] = torch.tensor(meta.prompt_lens_cpu, dtype=torch.int64)
        return meta.extras["tile_rows"]
