"""FLASH_ATTN_V100 kernels against a float64 reference over random paged, ragged, GQA batches.

Outputs are poisoned with NaN before each call, unused cache slots hold NaN, and every config
is compared element-wise: |out - ref| <= ATOL + RTOL * |ref| (bounds per KV dtype below).
"""
from __future__ import annotations

import json
import math
import os
import random

import pytest
import torch

from onecat.engine.attention.metadata import AttentionMetadata
from onecat.engine.cache.kv import LayerKVCache

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (SM70+)"),
]

# Bounds: FP16 KV -> FP16 P and FP16 output rounding (2^-11 relative) over FP32 accumulation.
# FP8 KV -> the reference uses the identical dequantised values (fp8 * scale) in float64; the
# prefill kernel additionally rounds fp8 * scale to FP16 once, which stays within the same bound.
TOLERANCES = {"f16": (3e-3, 1e-2), "e4m3": (3e-3, 1e-2), "e5m2": (3e-3, 1e-2)}  # (atol, rtol)
FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
FP8_MAX = {"e4m3": 448.0, "e5m2": 57344.0}
KIND = {"f16": 0, "e4m3": 1, "e5m2": 2}
RESULTS: list[dict] = []


def _ext():
    from onecat.engine.kernels.flash_attn_v100_ext import load_extension

    return load_extension()


def make_batch(seed, head_dim, kv, num_heads, num_kv_heads, block_size, lens, q_gain=2.0):
    """lens: list of (q_len, seq_len). Returns q, cache, meta with shuffled physical blocks."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    dev = "cuda"
    blocks_per_seq = [math.ceil(s / block_size) for _, s in lens]
    num_blocks = sum(blocks_per_seq) + 3
    perm = torch.randperm(num_blocks, generator=g).tolist()
    max_blocks = max(blocks_per_seq)
    tables = torch.zeros(len(lens), max_blocks, dtype=torch.int32)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_val = torch.full(shape, float("nan"), dtype=torch.float64)
    v_val = torch.full(shape, float("nan"), dtype=torch.float64)
    nxt = 0
    for b, (_, s) in enumerate(lens):
        for i in range(blocks_per_seq[b]):
            blk = perm[nxt]
            nxt += 1
            tables[b, i] = blk
            n = min(block_size, s - i * block_size)
            k_val[blk, :n] = torch.randn(n, num_kv_heads, head_dim, generator=g, dtype=torch.float64)
            v_val[blk, :n] = torch.randn(n, num_kv_heads, head_dim, generator=g, dtype=torch.float64)
    if kv == "f16":
        k_store, v_store = k_val.half(), v_val.half()
        k_ref, v_ref = k_store.double(), v_store.double()
        cache = LayerKVCache(k_store.to(dev), v_store.to(dev), None, None, None)
    else:
        def quant(x):
            amax = torch.nan_to_num(x.abs().amax(-1), nan=1.0).clamp_min(1e-3)
            scale = (amax / FP8_MAX[kv]).float()
            q8 = (x / scale.double()[..., None]).to(FP8[kv])
            q8 = torch.where(torch.isnan(x), torch.full_like(x, float("nan")), q8.double()).to(FP8[kv])
            return q8, scale
        k8, ks = quant(k_val)
        v8, vs = quant(v_val)
        k_ref = k8.double() * ks.double()[..., None]
        v_ref = v8.double() * vs.double()[..., None]
        cache = LayerKVCache(k8.view(torch.uint8).to(dev), v8.view(torch.uint8).to(dev), ks.to(dev), vs.to(dev), FP8[kv])
    q_lens = [ql for ql, _ in lens]
    T = sum(q_lens)
    q = (torch.randn(T, num_heads, head_dim, generator=g) * q_gain).half()
    qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    slots = []
    for b, (ql, s) in enumerate(lens):
        for pos in range(s - ql, s):
            slots.append(int(tables[b, pos // block_size]) * block_size + pos % block_size)
    meta = AttentionMetadata(
        query_start_loc=qsl.to(dev), seq_lens=torch.tensor([s for _, s in lens], dtype=torch.int32).to(dev),
        block_tables=tables.to(dev), slot_mapping=torch.tensor(slots, dtype=torch.int64).to(dev),
        max_query_len=max(q_lens), max_seq_len=max(s for _, s in lens), block_size=block_size,
        query_lens_cpu=q_lens, seq_lens_cpu=[s for _, s in lens], extras={})
    return q.to(dev), cache, meta, (k_ref, v_ref, tables, qsl)


def reference(q, meta, refs, scale, causal=True):
    k_ref, v_ref, tables, qsl = refs
    bs = meta.block_size
    H, D = q.shape[1], q.shape[2]
    Hkv = k_ref.shape[2]
    out = torch.zeros(q.shape, dtype=torch.float64)
    qd = q.double().cpu()
    for b, (ql, s) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
        nb = math.ceil(s / bs)
        blocks = tables[b, :nb].long()
        K = k_ref[blocks].reshape(-1, Hkv, D)[:s].repeat_interleave(H // Hkv, dim=1)
        V = v_ref[blocks].reshape(-1, Hkv, D)[:s].repeat_interleave(H // Hkv, dim=1)
        Q = qd[qsl[b]:qsl[b] + ql]
        S = torch.einsum("thd,khd->htk", Q, K) * scale
        if causal:
            pos = torch.arange(s - ql, s)[:, None]
            S = S.masked_fill(torch.arange(s)[None, :] > pos, float("-inf"))
        out[qsl[b]:qsl[b] + ql] = torch.einsum("htk,khd->thd", torch.softmax(S, dim=-1), V)
    return out


def check(name, out, ref, kv):
    atol, rtol = TOLERANCES[kv]
    out64 = out.double().cpu()
    assert not torch.isnan(out64).any(), f"{name}: NaN in output (unwritten rows or NaN leak)"
    err = (out64 - ref).abs()
    max_abs = err.max().item()
    max_rel = (err / ref.abs().clamp_min(1e-3)).max().item()
    bound_ok = bool((err <= atol + rtol * ref.abs()).all())
    RESULTS.append({"case": name, "max_abs_err": max_abs, "max_rel_err": max_rel,
                    "ref_max": ref.abs().max().item(), "ok": bound_ok})
    print(f"{name}: max_abs_err={max_abs:.3e} max_rel_err={max_rel:.3e} ok={bound_ok}")
    report_dir = os.environ.get("ONECAT_KERNEL_TEST_REPORT")
    if report_dir:
        with open(os.path.join(report_dir, "flash_attn_v100_errors.jsonl"), "a") as f:
            f.write(json.dumps(RESULTS[-1]) + "\n")
    assert bound_ok, f"{name}: max abs err {max_abs:.3e} exceeds {atol} + {rtol}*|ref|"


def _call(path, q, cache, meta, scale, causal=True, num_splits=0, variant=None):
    """variant: the kernel variant (decode 0/1, prefill 0-3); None: the extension's default."""
    ext = _ext()
    out = torch.full_like(q, float("nan"))
    kind = 0 if cache.fp8_dtype is None else (1 if cache.fp8_dtype == torch.float8_e4m3fn else 2)
    args = (out, q, cache.k, cache.v, cache.k_scale, cache.v_scale, kind, meta.query_start_loc,
            meta.seq_lens, meta.block_tables, meta.max_query_len)
    extra = () if variant is None else (variant,)
    if path == "prefill":
        ext.prefill(*args, scale, causal, *extra)
    else:
        ext.decode(*args, meta.max_seq_len, scale, num_splits, *extra)
    torch.cuda.synchronize()
    return out


PREFILL_CASES = [
    # (head_dim, kv, heads, kv_heads, block_size, [(q_len, seq_len), ...])
    (64, "f16", 4, 4, 16, [(1, 1), (37, 37), (100, 165), (64, 64), (130, 300)]),
    (64, "e4m3", 8, 2, 32, [(70, 70), (5, 200), (129, 129)]),
    (64, "e5m2", 4, 1, 8, [(33, 97), (64, 128)]),
    (128, "f16", 8, 2, 16, [(1, 1), (77, 77), (150, 333), (17, 18)]),
    (128, "e4m3", 4, 4, 64, [(200, 200), (3, 90)]),
    (128, "e5m2", 8, 8, 16, [(45, 245), (96, 96)]),
    (256, "f16", 4, 2, 16, [(65, 65), (31, 140), (1, 17)]),
    (256, "e4m3", 2, 1, 32, [(90, 150), (16, 16)]),
    (256, "e5m2", 8, 1, 16, [(40, 40), (70, 133)]),
]


# prefill variants (prefill.cuh): 0 the first kernel ... 3 the default
PREFILL_VARIANTS = (0, 1, 2, 3)


@pytest.mark.parametrize("variant", PREFILL_VARIANTS)
@pytest.mark.parametrize("case", PREFILL_CASES, ids=lambda c: f"d{c[0]}-{c[1]}-h{c[2]}kv{c[3]}-bs{c[4]}")
def test_prefill_matches_reference(case, variant):
    d, kv, h, hkv, bs, lens = case
    q, cache, meta, refs = make_batch(1000 + d, d, kv, h, hkv, bs, lens)
    scale = d ** -0.5
    out = _call("prefill", q, cache, meta, scale, variant=variant)
    check(f"prefill[v{variant}] d{d} {kv} h{h}/kv{hkv} bs{bs}", out, reference(q, meta, refs, scale), kv)


@pytest.mark.parametrize("variant", PREFILL_VARIANTS)
@pytest.mark.parametrize("d", [64, 128, 256])
def test_prefill_non_causal(d, variant):
    q, cache, meta, refs = make_batch(7 + d, d, "f16", 4, 2, 16, [(50, 50), (20, 90), (70, 70)])
    scale = d ** -0.5
    out = _call("prefill", q, cache, meta, scale, causal=False, variant=variant)
    check(f"prefill[v{variant}] non-causal d{d}", out, reference(q, meta, refs, scale, causal=False), "f16")


DECODE_CASES = [
    # (head_dim, kv, heads, kv_heads, block_size, seq_lens, num_splits (0 = auto))
    (64, "f16", 8, 2, 16, [1, 17, 33, 300, 1000], 0),
    (64, "e4m3", 4, 4, 32, [5, 64, 129], 3),
    (64, "e5m2", 16, 2, 16, [250, 31], 1),
    (128, "f16", 32, 4, 16, [1, 100, 2049], 0),
    (128, "e4m3", 8, 1, 16, [7, 513, 77], 0),
    (128, "e5m2", 4, 2, 64, [300, 1, 45], 5),
    (256, "f16", 8, 2, 16, [65, 1, 400], 0),
    (256, "e4m3", 16, 1, 32, [200, 90], 2),
    (256, "e5m2", 4, 4, 8, [33, 128], 0),
]


# decode variants: 0 stages K/V in shared memory, 1 keeps them in registers (rows <= 8)
VARIANTS = {"smem": 0, "regs": 1}


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("case", DECODE_CASES, ids=lambda c: f"d{c[0]}-{c[1]}-h{c[2]}kv{c[3]}-s{c[6]}")
def test_decode_matches_reference(case, variant):
    d, kv, h, hkv, bs, seq_lens, splits = case
    lens = [(1, s) for s in seq_lens]
    q, cache, meta, refs = make_batch(2000 + d, d, kv, h, hkv, bs, lens)
    scale = d ** -0.5
    out = _call("decode", q, cache, meta, scale, num_splits=splits, variant=VARIANTS[variant])
    check(f"decode[{variant}] d{d} {kv} h{h}/kv{hkv} bs{bs} splits={splits}", out,
          reference(q, meta, refs, scale), kv)


VERIFY_CASES = [
    # speculative verify: k+1 query tokens per sequence, causal among them
    (64, "f16", 8, 2, 16, [(4, 40), (2, 300), (5, 5)], 0),
    (128, "e4m3", 8, 2, 16, [(4, 129), (3, 700), (1, 20)], 0),
    (128, "f16", 4, 1, 32, [(8, 64), (6, 333)], 3),
    (256, "e5m2", 4, 1, 16, [(4, 100), (2, 57)], 0),
    (256, "f16", 8, 4, 16, [(8, 300), (3, 3)], 2),
    # q_len x group <= 8: the row buckets the register variant would serve (the binding keeps
    # q_len > 1 on the shared variant until these ran on a GPU with it)
    (64, "f16", 4, 4, 16, [(3, 50), (4, 4)], 0),
    (128, "e4m3", 4, 2, 16, [(4, 150), (2, 9), (1, 70)], 0),
]


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("case", VERIFY_CASES, ids=lambda c: f"d{c[0]}-{c[1]}-h{c[2]}kv{c[3]}")
def test_verify_matches_reference(case, variant):
    d, kv, h, hkv, bs, lens, splits = case
    q, cache, meta, refs = make_batch(3000 + d, d, kv, h, hkv, bs, lens)
    scale = d ** -0.5
    out = _call("decode", q, cache, meta, scale, num_splits=splits, variant=VARIANTS[variant])
    check(f"verify[{variant}] d{d} {kv} h{h}/kv{hkv} q_lens={[a for a, _ in lens]}", out,
          reference(q, meta, refs, scale), kv)


@pytest.mark.parametrize("seed", range(16))
def test_random_shapes(seed):
    """Random head dim, KV dtype, GQA ratio, page size, batch and ragged lengths; the decode
    kernel (when the packed rows fit) and the prefill kernel both checked on the same batch."""
    rng = random.Random(seed)
    d = rng.choice([64, 128, 256])
    kv = rng.choice(list(KIND))
    hkv = rng.choice([1, 2, 4])
    group = rng.choice([1, 2, 4, 8])
    bs = rng.choice([8, 16, 32, 64])
    max_rows = 16 if d == 256 else 32
    lens = []
    for _ in range(rng.randint(1, 5)):
        if seed % 2 == 0:  # decode / verify shaped
            ql = rng.randint(1, max(1, min(8, max_rows // group)))
            lens.append((ql, ql + rng.randint(0, 1500)))
        else:  # prefill shaped, with and without a cached prefix
            ql = rng.randint(1, 300)
            lens.append((ql, ql + rng.choice([0, rng.randint(1, 400)])))
    q, cache, meta, refs = make_batch(5000 + seed, d, kv, hkv * group, hkv, bs, lens)
    scale = d ** -0.5
    ref = reference(q, meta, refs, scale)
    tag = f"random#{seed} d{d} {kv} h{hkv * group}/kv{hkv} bs{bs} lens={lens}"
    for variant in PREFILL_VARIANTS:
        check(f"{tag} prefill[v{variant}]", _call("prefill", q, cache, meta, scale, variant=variant), ref, kv)
    if meta.max_query_len * group <= max_rows:
        splits = rng.choice([0, 0, 1, 2, 7])
        for name, variant in VARIANTS.items():
            out = _call("decode", q, cache, meta, scale, num_splits=splits, variant=variant)
            check(f"{tag} decode[{name}] splits={splits}", out, ref, kv)


@pytest.mark.parametrize("decode_variant", list(VARIANTS))
@pytest.mark.parametrize("kv", ["f16", "e4m3"])
def test_backend_forward_mixed_batch(kv, decode_variant):
    from onecat.engine.attention.flash_attn_v100 import FlashAttnV100Backend

    backend = FlashAttnV100Backend(decode_variant=decode_variant)
    for lens in ([(1, 50), (1, 700)], [(3, 30), (120, 260)]):  # decode path, then prefill path
        q, cache, meta, refs = make_batch(4000, 128, kv, 8, 2, 16, lens)
        reason = backend.unsupported_reason(q, cache, meta)
        assert reason is None, reason
        out = backend.forward(q, cache, meta, 128 ** -0.5)
        path = backend.path_for(q, cache, meta)
        check(f"backend {path} {kv} lens={lens}", out, reference(q, meta, refs, 128 ** -0.5), kv)


def test_backend_rejects_bf16_and_odd_head_dim():
    from onecat.engine.attention.flash_attn_v100 import FlashAttnV100Backend

    backend = FlashAttnV100Backend()
    q, cache, meta, _ = make_batch(5, 64, "f16", 4, 4, 16, [(3, 3)])
    assert "bfloat16" in backend.unsupported_reason(q.bfloat16(), cache, meta)
    q96 = torch.zeros(3, 4, 96, dtype=torch.float16, device="cuda")
    assert "head_dim 96" in backend.unsupported_reason(q96, cache, meta)
