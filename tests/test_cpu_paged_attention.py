"""The C++ CPU paged attention (csrc/cpu/paged_attention.cpp) against plain causal softmax attention.

(a) It agrees with a float64 reference computed from the dequantized cache, for ragged sequences spread
over shuffled blocks, float32 / bfloat16 / fp8 caches, with prefill and decode rows in one step; and (b) a
token's output has the same bits whatever else the step holds and whatever its query length (the engine's
CPU batch invariance, which the one-call decode step and the prefix cache rely on).
"""
from __future__ import annotations

import pytest
import torch

from onecat.engine.attention.cpu_paged import FP8_KINDS, CpuPagedBackend
from onecat.engine.attention.metadata import AttentionMetadata
from onecat.engine.attention.selector import AttentionDispatcher
from onecat.engine.kernels import cpu_ops
from onecat.engine.cache.kv import LayerKVCache, dequantize_fp8, quantize_fp8

pytestmark = pytest.mark.skipif(cpu_ops.unavailable_reason() is not None,
                                reason=f"CPU ops unavailable: {cpu_ops.unavailable_reason()}")
HQ, HKV, D, BS, BLOCKS = 9, 3, 64, 16, 40


def _cache(kind: str, gen: torch.Generator) -> tuple[LayerKVCache, torch.Tensor, torch.Tensor]:
    """A filled cache and its float32 dequantized K and V."""
    k, v = (torch.randn(BLOCKS, BS, HKV, D, generator=gen) for _ in range(2))
    if kind == "fp8":
        fp8 = torch.float8_e4m3fn
        (kq, ks), (vq, vs) = (quantize_fp8(t.view(-1, HKV, D), fp8) for t in (k, v))
        cache = LayerKVCache(kq.view(k.shape), vq.view(v.shape), ks.view(k.shape[:3]), vs.view(v.shape[:3]), fp8)
        return cache, dequantize_fp8(cache.k, cache.k_scale, fp8, torch.float32), \
            dequantize_fp8(cache.v, cache.v_scale, fp8, torch.float32)
    dtype = torch.bfloat16 if kind == "bf16" else torch.float32
    k, v = k.to(dtype), v.to(dtype)
    return LayerKVCache(k, v, None, None, None), k.float(), v.float()


def _meta(q_lens: list[int], seq_lens: list[int], tables: list[list[int]]) -> AttentionMetadata:
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    starts = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
    return AttentionMetadata(starts, torch.tensor(seq_lens, dtype=torch.int32), block_tables,
                             torch.zeros(sum(q_lens), dtype=torch.int64), max(q_lens), max(seq_lens), BS,
                             q_lens, seq_lens, {})


def _reference(q, k, v, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    out = torch.empty(q.shape, dtype=torch.float64)
    for b, (n, s) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
        blocks = meta.block_tables[b, : -(-s // BS)].long()
        kb = k[blocks].reshape(-1, HKV, D)[:s].double().repeat_interleave(HQ // HKV, dim=1)
        vb = v[blocks].reshape(-1, HKV, D)[:s].double().repeat_interleave(HQ // HKV, dim=1)
        start = int(meta.query_start_loc[b])
        for i in range(n):
            pos = s - n + i
            scores = torch.einsum("hd,khd->hk", q[start + i].double(), kb[:pos + 1]) * scale
            out[start + i] = torch.einsum("hk,khd->hd", scores.softmax(-1), vb[:pos + 1])
    return out


STEP = dict(q_lens=[1, 37, 1, 5], seq_lens=[1, 37, 200, 90],  # a first token, a prefill, decodes, a chunk
            tables=[[3], [7, 1, 9], [2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26], [30, 5, 11, 13, 15, 17]])


@pytest.mark.parametrize("kind,q_dtype,tol", [("fp32", torch.float32, 2e-5), ("bf16", torch.bfloat16, 2e-2),
                                             ("bf16", torch.float32, 2e-5), ("fp8", torch.float32, 2e-5)])
def test_matches_reference_on_ragged_paged_step(kind, q_dtype, tol):
    """float32 / bfloat16 queries; float32, bfloat16 (a float32 model's kv_cache_dtype bfloat16) and fp8 caches."""
    gen = torch.Generator().manual_seed(0)
    cache, k, v = _cache(kind, gen)
    meta = _meta(**STEP)
    q = torch.randn(sum(STEP["q_lens"]), HQ, D, generator=gen).to(q_dtype)
    backend = CpuPagedBackend()
    assert backend.unsupported_reason(q, cache, meta) is None
    out = backend.forward(q, cache, meta, D ** -0.5)
    assert out.dtype == q.dtype and out.shape == q.shape
    ref = _reference(q.float(), k, v, meta, D ** -0.5)
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("kind", ["fp32", "bf16"])
def test_token_results_do_not_depend_on_the_step(kind):
    """A token alone, in a step of many (whose bfloat16-cache decode rows read their blocks through a copy,
    several KV heads a job) or with a strided q: the same bits."""
    gen = torch.Generator().manual_seed(1)
    cache, _, _ = _cache(kind, gen)
    meta = _meta(**STEP)
    q = torch.randn(sum(STEP["q_lens"]), HQ, D, generator=gen)
    full = CpuPagedBackend().forward(q, cache, meta, 0.125)
    # sequence 1's last 3 prompt tokens alone (a prefix-cache hit: query length 3), and sequence 2 alone
    alone = _meta([3], [37], [STEP["tables"][1]])
    assert torch.equal(CpuPagedBackend().forward(q[35:38], cache, alone, 0.125), full[35:38])
    alone = _meta([1], [200], [STEP["tables"][2]])
    assert torch.equal(CpuPagedBackend().forward(q[38:39], cache, alone, 0.125), full[38:39])
    # a strided q (heads read in place from the fused qkv rows) gives the same bits
    qkv = torch.cat([q.reshape(q.shape[0], -1), torch.randn(q.shape[0], 2 * HKV * D, generator=gen)], dim=1)
    strided = qkv[:, : HQ * D].view(-1, HQ, D)
    assert not strided.is_contiguous()
    assert torch.equal(CpuPagedBackend().forward(strided, cache, meta, 0.125), full)


@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
def test_a_bfloat16_cache_gives_the_bits_of_its_float32_copy(q_dtype):
    """bfloat16 rows are widened where they are used (AVX2 builds) or into float32 copies (elsewhere); either way
    each value is widened exactly and used in the same order, so the same values in a float32 cache give the
    same bits, prefill runs and decode rows alike."""
    gen = torch.Generator().manual_seed(2)
    cache, k, v = _cache("bf16", gen)
    as_float = LayerKVCache(k.contiguous(), v.contiguous(), None, None, None)
    meta = _meta(**STEP)
    q = torch.randn(sum(STEP["q_lens"]), HQ, D, generator=gen).to(q_dtype)
    assert torch.equal(CpuPagedBackend().forward(q, cache, meta, 0.125),
                       CpuPagedBackend().forward(q, as_float, meta, 0.125))


@pytest.mark.parametrize("kind", ["fp32", "bf16"])
@pytest.mark.parametrize("group", [3, 12])
@pytest.mark.parametrize("dim", [D, 40])  # 40: the 512-bit value loop ends on eight lanes
def test_a_query_heads_bits_do_not_depend_on_the_heads_sharing_its_kv_head(kind, group, dim):
    """The G query heads of a KV head are scored and summed together (each key row widened once for all G, up to
    8 heads, in 512-bit registers where the CPU has AVX512; more heads take one head at a time on the 256-bit
    loop): each head's arithmetic is its own, so a cache with one KV head per query head (G = 1) gives the same
    bits, and the 12-head case ties the grouped loops to the one-head loop."""
    gen = torch.Generator().manual_seed(3)
    kv_heads = HQ // 3 if group == 3 else 1
    k, v = (torch.randn(BLOCKS, BS, kv_heads, dim, generator=gen) for _ in range(2))
    if kind == "bf16":
        k, v = k.to(torch.bfloat16), v.to(torch.bfloat16)
    meta = _meta(**STEP)
    q = torch.randn(sum(STEP["q_lens"]), kv_heads * group, dim, generator=gen)
    ops = cpu_ops.load()
    args = (meta.block_tables, meta.query_start_loc, meta.seq_lens, 0.125)
    shared = ops.paged_attention(q, k, v, None, None, 0, *args)
    one_each = ops.paged_attention(q, *(t.repeat_interleave(group, dim=2).contiguous() for t in (k, v)), None, None,
                                   0, *args)
    assert torch.equal(shared, one_each)


def test_refusals_and_auto_choice():
    cache, _, _ = _cache("fp32", torch.Generator().manual_seed(2))
    meta = _meta([1], [5], [[1]])
    backend = CpuPagedBackend()
    assert "head dim" in backend.unsupported_reason(torch.zeros(1, HQ, 24), cache, meta)
    assert "float32 or bfloat16" in backend.unsupported_reason(torch.zeros(1, HQ, D, dtype=torch.float16), cache, meta)
    assert set(FP8_KINDS) == {None, torch.float8_e4m3fn, torch.float8_e5m2}
    assert AttentionDispatcher("auto", torch.device("cpu")).primary_name == "CPU_PAGED"
    with pytest.raises(RuntimeError, match="query_start_loc"):
        cpu_ops.load().paged_attention(torch.zeros(2, HQ, D), cache.k, cache.v, None, None, 0,
                                       meta.block_tables, meta.query_start_loc, meta.seq_lens, 1.0)


@pytest.mark.parametrize("kind", ["fp32", "bf16"])
@pytest.mark.parametrize("group,dim", [(3, D), (4, 40), (1, D), (5, D)])
def test_a_prefills_tokens_have_the_bits_each_has_alone(kind, group, dim):
    """A 70-token prefill (runs of 16 tokens, in which tokens that see a whole chunk of keys go four at a time
    where the CPU has AVX512 and G <= 4) against each token computed alone as a one-token query over the same
    keys: the same bits for every token, whatever the group (5: no four-token path) or head dim."""
    gen = torch.Generator().manual_seed(4)
    k, v = (torch.randn(BLOCKS, BS, 2, dim, generator=gen) for _ in range(2))
    if kind == "bf16":
        k, v = k.to(torch.bfloat16), v.to(torch.bfloat16)
    table = [9, 3, 17, 1, 25]
    q = torch.randn(70, 2 * group, dim, generator=gen)
    ops = cpu_ops.load()

    def attend(rows: torch.Tensor, q_len: int, seq_len: int) -> torch.Tensor:
        meta = _meta([q_len], [seq_len], [table])
        return ops.paged_attention(rows, k, v, None, None, 0, meta.block_tables, meta.query_start_loc,
                                   meta.seq_lens, 0.125)

    prefill = attend(q, 70, 70)
    for i in range(70):
        assert torch.equal(attend(q[i:i + 1].contiguous(), 1, i + 1)[0], prefill[i]), f"token {i}"
