"""Tensor parallelism's GPU paths (skipped without CUDA): the one-shot peer-buffer collectives, and whole
engines with CUDA graphs whose steps hold the collectives.

With one GPU the ranks share it (ONECAT_TP_SHARE_DEVICE=1: a gloo group, every collective inside a graph
on the peer-buffer kernel; the ranks' kernels time-share the GPU); with two or more they run one per GPU
over NCCL as users run them.
"""
from __future__ import annotations

import os

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

WORLD = 2
SIZES = (1, 576, 4096 + 3, 70_000)  # one element; a hidden row; a tail; more than one pass of every block


def _two_gpus() -> bool:
    return torch.cuda.device_count() >= WORLD


def _bytes(obj) -> bytes:
    """Tensors as bytes: a queue would pass them as handles that die with the rank's process."""
    import io

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _rank_main(rank: int, port: int, out) -> None:
    import torch.distributed as dist

    from onecat.engine.parallel.peer_collectives import PeerBuffers
    from onecat.engine.parallel.runtime import RankInfo, init_group, rank_device

    try:
        device = rank_device(torch.device("cuda", 0), rank)
        init_group(RankInfo(rank, WORLD, port), device)
        peer = PeerBuffers.over_group(rank, WORLD, device)
        results = {}
        for dtype in (torch.float16, torch.bfloat16, torch.float32):
            for n in SIZES:
                for call in range(3):  # both parity halves, and one reused
                    g = torch.Generator().manual_seed(1000 * rank + 10 * call + n % 97)
                    x = torch.randn(n, generator=g).to(device, dtype)
                    peer.all_reduce(x)
                    gathered = peer.all_gather(torch.full((n,), float(rank + call), device=device, dtype=dtype))
                    results[(str(dtype), n, call)] = (x.cpu(), gathered.cpu())
        # inside a CUDA graph, replayed with new inputs each time
        static = torch.zeros(4096, device=device, dtype=torch.float16)
        summed = static.clone()
        peer.all_reduce(summed)  # compiles the kernel outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            summed.copy_(static)
            peer.all_reduce(summed)
        graphed = []
        for replay in range(4):
            static.copy_(torch.arange(4096, device=device, dtype=torch.float16) * (rank + 1) + replay)
            graph.replay()
            graphed.append(summed.cpu().clone())
        torch.cuda.synchronize(device)
        out.put((rank, _bytes((results, graphed)), bool(peer.timed_out.item())))
        dist.barrier()
        peer.close()
        dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 - the test reports the rank's own failure
        import traceback

        out.put((rank, f"{type(e).__name__}: {e}\n{traceback.format_exc()}", None))


def test_peer_collectives_sum_in_rank_order_and_replay_in_graphs(monkeypatch):
    """Every rank gets the rank-order float32 sum, bit for bit the same on every rank, for fp16, bf16 and
    fp32, over repeated calls (both halves) and sizes from one element to several passes; all-gather
    returns each rank's tensor; the kernel replays inside a CUDA graph with fresh inputs each time."""
    import multiprocessing as mp

    from onecat.engine.parallel.runtime import SHARE_DEVICE_ENV, free_port

    if not _two_gpus():
        monkeypatch.setenv(SHARE_DEVICE_ENV, "1")
    ctx = mp.get_context("spawn")
    out, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, port, out)) for r in range(WORLD)]
    for p in procs:
        p.start()
    try:
        got = {}
        for _ in range(WORLD):
            import io

            rank, payload, timed_out = out.get(timeout=300)
            assert isinstance(payload, bytes), f"rank {rank} failed: {payload}"
            results, graphed = torch.load(io.BytesIO(payload))
            got[rank] = (results, graphed, timed_out)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        for n in SIZES:
            for call in range(3):
                inputs = [torch.randn(n, generator=torch.Generator().manual_seed(1000 * r + 10 * call + n % 97))
                          .to(dtype) for r in range(WORLD)]
                want = sum(x.float() for x in inputs).to(dtype)
                for r in range(WORLD):
                    summed, gathered = got[r][0][(str(dtype), n, call)]
                    assert torch.equal(summed, want), (dtype, n, call, r)
                    for q in range(WORLD):
                        assert torch.equal(gathered[q], torch.full((n,), float(q + call), dtype=dtype))
    base = torch.arange(4096, dtype=torch.float16)
    for replay in range(4):
        want = sum((base * (r + 1) + replay).float() for r in range(WORLD)).half()
        for r in range(WORLD):
            assert torch.equal(got[r][1][replay], want), (replay, r)
    assert not any(got[r][2] for r in range(WORLD))


def _llm(model_dir, **kw):
    from onecat.engine import LLM

    args = dict(max_model_len=256, max_num_batched_tokens=512, max_num_seqs=2, seed=0, kv_cache_memory_gb=0.5,
                device="cuda", dtype="float16")
    args.update(kw)
    return LLM(str(model_dir), **args)


# TP=4 (3 KV heads over 4 ranks: replicated KV heads, query heads 2/1/3/3) where 4 GPUs are present
WORLDS = [2, 4] if torch.cuda.is_available() and torch.cuda.device_count() >= 4 else [2]


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e5m2"])
def test_tp_with_cuda_graphs_matches_tp1(tmp_path, monkeypatch, kv_cache_dtype, world):
    """TP=2 (uneven heads: 9 query / 3 KV) with CUDA graphs holding the collectives, and a sharded fp8 KV
    cache: the prompt scores track TP=1 to fp16 rounding of the row-parallel sums, decode steps replay
    graphs on every rank, greedy tokens are generated and the small sums took the peer-buffer kernel."""
    from onecat.engine import SamplingParams
    from onecat.engine.parallel.runtime import SHARE_DEVICE_ENV
    from tests.test_speculative import PROMPTS
    from tests.tiny_models import make_tiny_model

    if not _two_gpus():
        monkeypatch.setenv(SHARE_DEVICE_ENV, "1")
    model_dir = make_tiny_model("llama", tmp_path / "tiny", hidden_size=144, num_attention_heads=9,
                                num_key_value_heads=3)
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    runs = {}
    for tp in (1, world):
        llm = _llm(model_dir, kv_cache_dtype=kv_cache_dtype, tensor_parallel_size=tp, cuda_graph="full")
        try:
            scores = [s.logprobs for s in llm.score(PROMPTS[1:3])]
            outs = [llm.generate(p, greedy)[0] for p in PROMPTS[1:3]]
            report = llm.cuda_graph_report()
            info = llm.info()["tensor_parallel"]
            runs[tp] = (scores, outs, report, info)
        finally:
            llm.close()
    for a, b in zip(runs[1][0], runs[world][0]):
        assert max(abs(x - y) for x, y in zip(a, b)) < 2e-2
    _, outs, report, info = runs[world]
    assert report["replays"] > 0 and report["disabled_reason"] is None
    assert info["gpu_peer_collectives"].startswith("one-shot kernel"), info
    assert info["backend"] == ("nccl" if _two_gpus() else "gloo")
    for base, tp2 in zip(runs[1][1], outs):
        assert len(tp2.token_ids) == 12
        # where the two runs' tokens part, TP=1's choice was a near-tie for TP=2 (summation order only)
        for step, (t1, t2) in enumerate(zip(base.token_ids, tp2.token_ids)):
            if t1 != t2:
                assert abs(tp2.logprobs[step][t2] - tp2.logprobs[step].get(t1, -1e9)) < 2e-2
                break


def test_tp2_dead_rank_between_graph_steps_fails_cleanly(tmp_path, monkeypatch):
    """A worker killed between decode steps (graphs on) ends the engine with a clear error and no process
    left behind."""
    import signal

    from onecat.engine import SamplingParams
    from onecat.engine.parallel.runtime import SHARE_DEVICE_ENV, TensorParallelError
    from tests.tiny_models import make_tiny_model

    if not _two_gpus():
        monkeypatch.setenv(SHARE_DEVICE_ENV, "1")
    model_dir = make_tiny_model("llama", tmp_path / "tiny", hidden_size=144, num_attention_heads=9,
                                num_key_value_heads=3)
    llm = _llm(model_dir, tensor_parallel_size=2, cuda_graph="full")
    try:
        llm.generate("a b c", SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
        worker = llm.worker.runner.peers.procs[0]
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(timeout=10)
        with pytest.raises(TensorParallelError, match="rank 1"):
            llm.generate("a b c d", SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
        assert not any(llm.worker.runner.peers.alive())
    finally:
        llm.close()


@pytest.mark.skipif(not _two_gpus(), reason="needs 2 CUDA GPUs (NCCL refuses two ranks on one)")
def test_tp2_nccl_only_graphs_match_peer_kernel_graphs(tmp_path):
    """disable_custom_all_reduce: every sum is an NCCL call captured in the graphs; greedy tokens equal the
    peer-kernel run's (both sum two ranks' fp16 partials in float32 or better, then round once)."""
    from onecat.engine import SamplingParams
    from tests.test_speculative import PROMPTS
    from tests.tiny_models import make_tiny_model

    model_dir = make_tiny_model("llama", tmp_path / "tiny", hidden_size=144, num_attention_heads=9,
                                num_key_value_heads=3)
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    runs = {}
    for nccl_only in (False, True):
        llm = _llm(model_dir, tensor_parallel_size=2, cuda_graph="full", disable_custom_all_reduce=nccl_only)
        try:
            runs[nccl_only] = [llm.generate(p, greedy)[0].token_ids for p in PROMPTS[1:3]]
            assert llm.cuda_graph_report()["replays"] > 0
            peer = llm.info()["tensor_parallel"]["gpu_peer_collectives"]
            assert peer.startswith("off") if nccl_only else peer.startswith("one-shot"), peer
        finally:
            llm.close()
    assert runs[True] == runs[False]
