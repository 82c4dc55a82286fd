"""The engine on CUDA (GPU only; skipped without one): fp16 engine vs CPU fp32, TRITON_PAGED vs the
reference backend on random paged caches (fp16 and fp8 KV), and CUDA graphs on/off greedy equality."""
from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PROMPTS = [" ".join(f"t{(i * 7 + j * 3) % 300 + 1}" for j in range(n)) for i, n in enumerate((5, 37, 130, 260))]


def _sm80() -> bool:
    return torch.cuda.get_device_capability() >= (8, 0)


def _paged_case(qlens, slens, num_heads, num_kv_heads, head_dim, block_size, fp8_dtype, dtype, seed):
    """A random paged cache holding each sequence's context in shuffled blocks, plus the step's metadata."""
    from onecat.engine.attention.metadata import AttentionMetadata
    from onecat.engine.cache.kv import allocate_kv_caches, write_kv

    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-s // block_size) for s in slens) + 5
    cache = allocate_kv_caches(1, num_blocks, block_size, num_kv_heads, head_dim, dtype, fp8_dtype, dev)[0]
    free = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables, new_slots, qsl = [], [], [0]
    for n, s in zip(qlens, slens):
        table = [free.pop() for _ in range(-(-s // block_size))]
        tables.append(table)
        slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(s)])
        k = torch.randn(s, num_kv_heads, head_dim, generator=gen).to(dev, dtype)
        v = torch.randn(s, num_kv_heads, head_dim, generator=gen).to(dev, dtype)
        write_kv(cache, k, v, slots.to(dev))
        new_slots += slots[s - n:].tolist()
        qsl.append(qsl[-1] + n)
    width = max(map(len, tables))
    i32 = dict(dtype=torch.int32, device=dev)
    meta = AttentionMetadata(torch.tensor(qsl, **i32), torch.tensor(slens, **i32),
                             torch.tensor([t + [0] * (width - len(t)) for t in tables], **i32),
                             torch.tensor(new_slots, dtype=torch.int64, device=dev), max(qlens), max(slens),
                             block_size, list(qlens), list(slens), {})
    q = torch.randn(qsl[-1], num_heads, head_dim, generator=gen).to(dev, dtype)
    return q, cache, meta


CASES = [([1] * 8, [1, 15, 16, 128, 129, 257, 1000, 3000]),  # pure decode, partition and block edges
         ([1, 4, 40, 1, 300], [700, 260, 40, 33, 900]),  # mixed: decode, verify-sized, fresh and cached prefill
         ([1, 1, 1, 4], [8192, 8193, 12000, 9000])]  # either side of the long sequences' 512-token partitions


@pytest.mark.skipif(not torch.cuda.is_available() or not _sm80(), reason="TRITON_PAGED needs SM80+")
@pytest.mark.parametrize("fp8_dtype", [None, torch.float8_e4m3fn, torch.float8_e5m2], ids=["fp16", "e4m3", "e5m2"])
@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("heads", [(8, 2, 64), (32, 8, 128), (4, 4, 128)], ids=["gqa4-d64", "gqa4-d128", "mha"])
def test_triton_paged_matches_reference(fp8_dtype, case, heads, monkeypatch):
    from onecat.engine.kernels import triton_paged_decode as tpd

    if case == 2:  # the long sequences in their 512-token partitions (the default; ONECAT_PAGED_LONG_PARTITION=0)
        monkeypatch.setattr(tpd, "LONG_PARTITION", 512)
    from onecat.engine.attention.torch_ref import TorchReferenceBackend
    from onecat.engine.attention.triton_paged import TritonPagedBackend
    from onecat.engine.cache.kv import LayerKVCache

    qlens, slens = CASES[case]
    q, cache, meta = _paged_case(qlens, slens, *heads, 16, fp8_dtype, torch.float16, seed=case)
    backend = TritonPagedBackend()
    assert backend.unsupported_reason(q, cache, meta) is None
    out = backend.forward(q, cache, meta, heads[2] ** -0.5)
    meta.extras.clear()
    # float64 reference over the same stored values (fp8 bytes are dequantized to float64 by the reference)
    ref_cache = cache if fp8_dtype else LayerKVCache(cache.k.double(), cache.v.double(), None, None, None)
    ref = TorchReferenceBackend().forward(q.double(), ref_cache, meta, heads[2] ** -0.5)
    assert torch.isfinite(out).all()
    err = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
    print(f"relative error {err:.2e}")
    assert err < 5e-3, err


def _replayed(step):
    """`step` captured in a CUDA graph and replayed three times: its output buffer, as the replays left it."""
    torch.cuda.synchronize()
    cg = torch.cuda.CUDAGraph()
    with torch.cuda.graph(cg):
        out = step()
    for _ in range(3):
        cg.replay()
    torch.cuda.synchronize()
    return out


@pytest.mark.skipif(not torch.cuda.is_available() or not _sm80(), reason="TRITON_PAGED needs SM80+")
@pytest.mark.parametrize("wide", [True, False])
@pytest.mark.parametrize("graph", [False, True])
def test_one_pass_merge_changes_no_bit(monkeypatch, wide, graph):
    """The decode step's pattern: the fused rope kernel writes each sequence's newest K/V, then the split kernel
    (one 128-token tile per partition or two 64-token tiles) and the merge, in one pass up to 16 partitions (the
    3000-token sequence takes the two-pass loop): one pass or two give the same bits, eagerly and replayed."""
    from onecat.engine.kernels import triton_paged_decode as tpd
    from onecat.engine.kernels.triton_fused import qk_rope_cache

    monkeypatch.setattr(tpd, "WIDE_TILE", wide)
    hq, hkv, d, dt = 32, 8, 128, torch.bfloat16
    _, cache, meta = _paged_case([1] * 8, CASES[0][1], hq, hkv, d, 16, None, dt, seed=7)
    t = meta.seq_lens.numel()
    gen = torch.Generator(device="cuda").manual_seed(7)
    qkv0 = torch.randn(t, (hq + 2 * hkv) * d, generator=gen, device="cuda").to(dt)
    qkv = qkv0.clone()
    cos = torch.rand(4096, d, generator=gen, device="cuda")
    sin = torch.rand(4096, d, generator=gen, device="cuda")
    positions = (meta.seq_lens - 1).long()

    def step():
        qkv.copy_(qkv0)
        qk_rope_cache(qkv, positions, cos, sin, hq, hkv, d, cache.k, cache.v, meta.slot_mapping, None, None, 0.0)
        out = torch.empty(t, hq, d, dtype=dt, device="cuda")
        tpd.paged_decode(out, qkv[:, :hq * d].view(t, hq, d), cache, meta.block_tables, meta.seq_lens,
                         meta.max_seq_len, d ** -0.5)
        return out

    results = {}
    for one_pass in (False, True):
        monkeypatch.setattr(tpd, "MERGE_ONE_PASS", one_pass)
        if graph:
            step()
            out = _replayed(step)
        else:
            out = step()
        results[one_pass] = out.clone()
    assert torch.isfinite(results[False]).all()
    assert torch.equal(results[True], results[False])


@pytest.mark.skipif(not torch.cuda.is_available() or not _sm80(), reason="TRITON_PAGED needs SM80+")
@pytest.mark.parametrize("indirect", [False, True])
def test_merge_in_split_matches_the_merge_kernel(monkeypatch, indirect):
    """MERGE_IN_SPLIT (each (token, KV head)'s last split program merges): the merge kernel's result to rounding
    (its reductions run on another warp layout), the same bits eagerly and replayed in a CUDA graph, each row's
    bits alone as in the batch, and every counter zero again after each launch."""
    from onecat.engine.kernels import triton_paged_decode as tpd

    hq, hkv, d, dt = 32, 8, 128, torch.bfloat16
    qlens, slens = ([1] * 8, CASES[0][1]) if not indirect else ([4, 4], [300, 1000])
    q, cache, meta = _paged_case(qlens, slens, hq, hkv, d, 16, None, dt, seed=3)
    t = q.shape[0]
    if indirect:  # the verify layout: work item j is token j of its sequence, seeing its context up to itself
        row = torch.repeat_interleave(torch.arange(len(qlens), device="cuda"), torch.tensor(qlens, device="cuda"))
        ctx = torch.cat([torch.arange(s - n + 1, s + 1) for n, s in zip(qlens, slens)]).to("cuda", torch.int32)
        extra = dict(tok_idx=torch.arange(t, device="cuda", dtype=torch.int32), row_idx=row.to(torch.int32))
    else:
        ctx, extra = meta.seq_lens, {}

    def run(rows=slice(None)):  # direct: rows of the batch; indirect: always all work items
        if indirect:
            out = torch.zeros(t, hq, d, dtype=dt, device="cuda")
            tpd.paged_decode(out, q, cache, meta.block_tables, ctx, meta.max_seq_len, d ** -0.5, **extra)
            return out
        lens = ctx[rows]
        out = torch.zeros(lens.numel(), hq, d, dtype=dt, device="cuda")
        tpd.paged_decode(out, q[rows], cache, meta.block_tables[rows], lens, meta.max_seq_len, d ** -0.5)
        return out

    monkeypatch.setattr(tpd, "MERGE_IN_SPLIT", False)
    want = run()
    monkeypatch.setattr(tpd, "MERGE_IN_SPLIT", True)
    got = run()
    assert int(tpd._COUNTERS[got.device].abs().sum()) == 0
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)
    replayed = _replayed(run)
    assert torch.equal(replayed, got) and int(tpd._COUNTERS[got.device].abs().sum()) == 0
    if not indirect:
        assert torch.equal(run(slice(3, 4))[0], got[3])  # a row's bits do not depend on its batch


def _llm(model_dir, **kw):
    from onecat.engine import LLM

    args = dict(max_model_len=512, max_num_batched_tokens=1024, seed=0, kv_cache_memory_gb=1.0)
    args.update(kw)
    return LLM(str(model_dir), **args)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_fp16_cuda_engine_tracks_cpu_fp32(tmp_path, arch):
    from onecat.engine import SamplingParams
    from tests.tiny_models import make_tiny_model

    model_dir = make_tiny_model(arch, tmp_path / arch, hidden_size=256, num_attention_heads=4, num_key_value_heads=2)
    cpu = _llm(model_dir, device="cpu", dtype="float32")
    gpu = _llm(model_dir, device="cuda", dtype="float16", cuda_graph=True)
    try:
        ref = cpu.score(PROMPTS)
        got = gpu.score(PROMPTS)
        worst = max(max(abs(a - b) for a, b in zip(r.logprobs, g.logprobs)) for r, g in zip(ref, got))
        print(f"{arch}: max |prompt logprob diff| fp16 CUDA vs fp32 CPU = {worst:.4f}")
        assert worst < 0.05, worst
        params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
        ref_tok = [o.token_ids for o in cpu.generate(PROMPTS, params)]
        got_tok = [o.token_ids for o in gpu.generate(PROMPTS, params)]
        agree = [next((i for i, (a, b) in enumerate(zip(r, g)) if a != b), len(r)) for r, g in zip(ref_tok, got_tok)]
        print(f"{arch}: greedy agreement per prompt {agree}")
        assert sum(agree) >= len(PROMPTS) * 16 // 2, agree
        info = gpu.info()
        assert info["attention_backend"]["effective"] == ("TRITON_PAGED" if _sm80() else info["attention_backend"]
                                                          ["effective"])
        assert info["cuda_graph"] is True, gpu.cuda_graph_report()
        sampled = gpu.generate(PROMPTS[:2], SamplingParams(temperature=0.8, top_p=0.9, max_tokens=8, seed=3,
                                                           ignore_eos=True))
        assert all(len(o.token_ids) == 8 for o in sampled)
    finally:
        cpu.close()
        gpu.close()


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_cuda_graphs_on_off_greedy_identical(tmp_path, kv_cache_dtype):
    from onecat.engine import SamplingParams
    from tests.tiny_models import make_tiny_model

    model_dir = make_tiny_model("llama", tmp_path / "tiny", hidden_size=256, num_attention_heads=8,
                                num_key_value_heads=2)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    results = {}
    for graphs in (False, True):
        llm = _llm(model_dir, device="cuda", dtype="float16", cuda_graph=graphs, kv_cache_dtype=kv_cache_dtype)
        try:
            # all prompts prefill in one step, so every decode step runs at a captured batch size (4, then 1)
            results[graphs] = ([o.token_ids for o in llm.generate(PROMPTS, params)],
                               llm.generate(PROMPTS[2], params)[0].token_ids)
            info = llm.info()
            report = llm.cuda_graph_report()
            assert info["cuda_graph"] is graphs, report
            if graphs:
                assert report["replays"] > 0 and {1, 4} <= set(report["captured_sizes"]), report
                # every graph was captured once, and the captures' time is counted
                assert report["captures"] == len(report["captured_sizes"]) and report["capture_s"] > 0, report
        finally:
            llm.close()
    assert results[True] == results[False]


def test_async_scheduling_on_off_identical(tmp_path, monkeypatch):
    """One-step-ahead decoding changes no token: early stops by length and by stop token, a sampled
    request beside a greedy one, a batch of sampled requests (keyed draws: the pipeline runs them too, their
    draws from a captured graph, a top-p row without top-k included: no read-back on a GPU), and a later call
    after a dropped step."""
    from onecat.engine import SamplingParams
    from onecat.engine.core import decode_pipeline
    from tests.tiny_models import make_tiny_model

    monkeypatch.setattr(decode_pipeline, "SAMPLER_GRAPHS", True)
    model_dir = make_tiny_model("llama", tmp_path / "tiny", hidden_size=256, num_attention_heads=8,
                                num_key_value_heads=2)
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    results, launches = {}, {}
    for on in (False, True):
        llm = _llm(model_dir, device="cuda", dtype="float16", cuda_graph=True, async_scheduling=on)
        try:
            if not on:  # a stop token that really occurs mid-way through prompt 1's continuation
                stop_tok = llm.generate(PROMPTS[1], greedy)[0].token_ids[6]
            params = [SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),
                      SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[stop_tok], ignore_eos=True),
                      greedy, SamplingParams(temperature=0.0, max_tokens=17, ignore_eos=True)]
            first = [(o.token_ids, o.finish_reason) for o in llm.generate(PROMPTS, params)]
            mixed = [o.token_ids for o in llm.generate(
                PROMPTS[:2], [greedy, SamplingParams(temperature=0.9, top_p=0.8, max_tokens=12, seed=5, ignore_eos=True)])]
            before = llm.info()["async_scheduling"]["launches"]
            sampled = [o.token_ids for o in llm.generate(PROMPTS[:4], [  # top-k, whole vocabulary, top-k + top-p,
                SamplingParams(temperature=0.9, top_k=40, max_tokens=30, seed=1, ignore_eos=True),  # top-p alone
                SamplingParams(temperature=1.0, max_tokens=30, seed=2, ignore_eos=True),
                SamplingParams(temperature=0.7, top_p=0.9, top_k=50, max_tokens=30, seed=3, ignore_eos=True),
                SamplingParams(temperature=0.8, top_p=0.9, max_tokens=30, seed=4, ignore_eos=True)])]
            sampled_launches = llm.info()["async_scheduling"]["launches"] - before
            if on:  # that steady sampled batch's draws replay a captured graph (sampler_graphs.py)
                assert llm.info()["async_scheduling"]["sampling_graphs"]["replays"] > 20
            again = llm.generate(PROMPTS[3], greedy)[0].token_ids
            results[on] = (first, mixed, sampled, again)
            launches[on] = (llm.info()["async_scheduling"]["launches"], sampled_launches)
        finally:
            llm.close()
    assert results[True] == results[False]
    assert launches[False] == (0, 0) and launches[True][0] > 40 and launches[True][1] > 20, launches


@pytest.mark.skipif(torch.cuda.is_available() and not _sm80(), reason="verify graphs need TRITON_PAGED (SM80+)")
@pytest.mark.parametrize("method", ["draft_model", "dflash"])
def test_speculative_verify_steps_replay_graphs_with_the_eager_tokens(tmp_path, method):
    """Verify steps of 1 + k tokens per sequence replay CUDA graphs (with the drafter's tapped hidden
    states as a graph output for DFlash) and give the tokens of the same engine without graphs."""
    from onecat.engine import SamplingParams
    from tests.test_speculative import write_random_dflash
    from tests.tiny_models import make_tiny_model

    model_dir = make_tiny_model("llama", tmp_path / "tiny", hidden_size=256, num_attention_heads=8,
                                num_key_value_heads=2)
    if method == "draft_model":  # the target drafting for itself: every draft accepted, k per round
        spec = {"method": "draft_model", "model": str(model_dir), "num_speculative_tokens": 3}
    else:
        drafter = write_random_dflash(tmp_path / "dflash", 256, 0, [0, 1], block_size=4)
        spec = {"method": "dflash", "model": str(drafter), "num_speculative_tokens": 3}
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    results = {}
    for graphs in (False, True):
        llm = _llm(model_dir, device="cuda", dtype="float16", cuda_graph=graphs, speculative_config=spec)
        try:
            results[graphs] = ([o.token_ids for o in llm.generate(PROMPTS[:2], params)],
                               llm.generate(PROMPTS[2], params)[0].token_ids)
            report = llm.cuda_graph_report()
            if method == "dflash":  # the drafter drafts through the fused kernels (speculative/dflash_fused.py)
                assert llm.info()["speculative"]["fused_kernels"] is True
            if graphs:
                assert report["verify_query_len"] == 4 and report["verify_disabled_reason"] is None, report
                assert report["verify_replays"] > 0 and {1, 2} <= set(report["captured_verify_sizes"]), report
        finally:
            llm.close()
    assert results[True] == results[False]


@pytest.mark.skipif(torch.cuda.is_available() and not _sm80(), reason="verify graphs need TRITON_PAGED (SM80+)")
@pytest.mark.parametrize("graphs", [False, True])
def test_batch1_speculation_reproduces_target_only_bit_for_bit(tmp_path, graphs):
    """With exact_batch1, a batch-1 verify step's rows go through the batch-1 GEMV, so the speculative engine
    computes every token's logits exactly as target-only batch-1 decode does: tokens and their logprobs equal."""
    from onecat.engine import SamplingParams
    from tests.tiny_models import make_tiny_model

    model_dir = make_tiny_model("llama", tmp_path / "tiny", hidden_size=256, num_attention_heads=8,
                                num_key_value_heads=2)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=0)
    spec = {"method": "draft_model", "model": str(model_dir), "num_speculative_tokens": 3, "exact_batch1": True}
    runs = {}
    for name, extra in (("target_only", {}), ("speculative", {"speculative_config": spec})):
        llm = _llm(model_dir, device="cuda", dtype="float16", cuda_graph=graphs, **extra)
        try:
            runs[name] = [llm.generate(p, params)[0] for p in PROMPTS[1:3]]
        finally:
            llm.close()
    for base, fast in zip(runs["target_only"], runs["speculative"]):
        assert fast.token_ids == base.token_ids
        assert [d[t] for d, t in zip(fast.logprobs, fast.token_ids)] == \
            [d[t] for d, t in zip(base.logprobs, base.token_ids)]


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e5m2"])
def test_tensor_parallel_2_gpus_matches_one(tmp_path, kv_cache_dtype):
    """TP=2 over NCCL (uneven heads: 9 query / 3 KV) scores prompts as one GPU does, to fp16 rounding of
    the row-parallel sums, with a sharded fp8 KV cache too; greedy generation runs on both ranks."""
    from onecat.engine import SamplingParams
    from tests.tiny_models import make_tiny_model

    model_dir = make_tiny_model("llama", tmp_path / "tiny", hidden_size=144, num_attention_heads=9,
                                num_key_value_heads=3)
    scores, tokens = {}, {}
    for tp in (1, 2):
        llm = _llm(model_dir, device="cuda", dtype="float16", kv_cache_dtype=kv_cache_dtype,
                   tensor_parallel_size=tp)
        try:
            scores[tp] = [s.logprobs for s in llm.score(PROMPTS[1:3])]
            tokens[tp] = llm.generate(PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=16,
                                                                 ignore_eos=True))[0].token_ids
            if tp == 2:
                assert llm.info()["tensor_parallel"]["backend"] == "nccl"
        finally:
            llm.close()
    for a, b in zip(scores[1], scores[2]):
        assert max(abs(x - y) for x, y in zip(a, b)) < 2e-2
    assert len(tokens[2]) == 16
