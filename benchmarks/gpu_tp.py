"""Tensor-parallel decode on the GPUs of one host: onecat TP=N against TP=1, and the all-reduce cost.

    python benchmarks/gpu_tp.py --tensor-parallel-size 2 --out benchmarks/results/gpu_h200x2_tp.json
    python benchmarks/gpu_tp.py --tensor-parallel-size 4 --sizes 1,2,4 --contexts 1024,16384 \
        --out benchmarks/results/gpu_h200x4_tp.json

1. Ceilings: every GPU's device-to-device copy bandwidth; TP=N's limit is their sum.
2. One all-reduce, N ranks (one process each): NCCL eager, NCCL inside a CUDA graph, and onecat's one-shot
   kernel over peer-mapped buffers inside a graph; a hidden row (8 KB fp16 at hidden 4096), 32 rows and
   1 MiB. Median microseconds per call over a graph of 50 calls (eager: 200 calls).
3. Llama-3-8B shape, random fp16 weights (load_format dummy: speed only): batch-1 decode at 1K context
   and batch 32 at 512, TP=1 vs TP=N (CUDA graphs; TP=N with the peer kernel and with NCCL only),
   tok/s, the fraction of the combined copy-bandwidth limit ((weight + KV bytes read per step, over all
   ranks) / summed bandwidth), and the all-reduces' share of a step from part 2.

`--shape llama3-70b` is the moonshot: ~140 GB of fp16 weights, loaded as one share per rank (the TP=1 arm
does not fit one H200 and records its error).

With ONECAT_TP_SHARE_DEVICE=1 on a one-GPU host the ranks share that GPU: the script then only checks
that every part runs (the ranks' kernels time-share one GPU; its figures mean nothing and say so).
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import multiprocessing as mp
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

from gpu_decode import GEN, SHAPES, ceilings, log, make_model_dir, prompts
from gpu_gemv import graph_time

ALLREDUCE_BYTES = (8 << 10, 256 << 10, 1 << 20)


def _share_device() -> bool:
    return os.environ.get("ONECAT_TP_SHARE_DEVICE") == "1"


# ---- all-reduce cost ------------------------------------------------------------------------------
def _graph_us(fn, calls: int = 50) -> float:
    """Median microseconds per call of `fn` captured `calls` times in one graph."""
    return graph_time([fn] * calls) * 1e6


def _allreduce_rank(rank: int, world: int, port: int, out) -> None:
    import torch.distributed as dist

    from onecat.engine.parallel.peer_collectives import PeerBuffers
    from onecat.engine.parallel.runtime import RankInfo, init_group, rank_device

    device = rank_device(torch.device("cuda", 0), rank)
    init_group(RankInfo(rank, world, port), device)
    peer = PeerBuffers.over_group(rank, world, device)
    res = {}
    for nbytes in ALLREDUCE_BYTES:
        t = torch.ones(nbytes // 2, dtype=torch.float16, device=device)
        row = {"peer_kernel_graph_us": _graph_us(lambda: peer.all_reduce(t))}
        if not _share_device():  # NCCL refuses two ranks on one GPU
            dist.barrier()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(200):
                dist.all_reduce(t)
            torch.cuda.synchronize()
            row["nccl_eager_us"] = (time.perf_counter() - t0) / 200 * 1e6
            row["nccl_graph_us"] = _graph_us(lambda: dist.all_reduce(t))
        res[nbytes] = row
    out.put((rank, res))
    dist.barrier()
    peer.close()
    dist.destroy_process_group()


def allreduce_costs(world: int) -> dict:
    from onecat.engine.parallel.runtime import free_port

    ctx = mp.get_context("spawn")
    out, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_allreduce_rank, args=(r, world, port, out)) for r in range(world)]
    for p in procs:
        p.start()
    got = dict(out.get(timeout=300) for _ in range(world))
    for p in procs:
        p.join(timeout=60)
    return {str(n): got[0][n] for n in ALLREDUCE_BYTES}


# ---- onecat TP=1 vs TP=N --------------------------------------------------------------------------
def decode(llm, batch: int, ctx: int, gen: int, vocab: int) -> tuple[dict, list]:
    from onecat.engine import SamplingParams

    outs = llm.generate(prompts(batch, ctx, vocab, batch), SamplingParams(temperature=0.0, max_tokens=gen,
                                                                          ignore_eos=True))
    decode_s = max(o.timings.decode_s for o in outs)
    return {"tok_s": batch * (gen - 1) / decode_s, "step_ms": 1e3 * decode_s / (gen - 1)}, [o.token_ids for o in outs]


def bench_arm(model_dir: Path, cfg: dict, tp: int, peer: bool, bw: float, contexts: list[int]) -> dict:
    """One engine: `bw` is the copy bandwidth of the GPUs it runs on, summed (bytes/s); batch-1 decode at
    each context length, then batch 32 at 512."""
    from onecat.engine import LLM

    llm = LLM(str(model_dir), load_format="dummy", dtype="float16", device="cuda", tensor_parallel_size=tp,
              disable_custom_all_reduce=not peer, cuda_graph="full", max_model_len=max(contexts) + GEN + 64,
              max_num_seqs=32, max_num_batched_tokens=32 * 512 + 256, kv_cache_memory_gb=16.0,
              enable_prefix_caching=False)
    try:
        per_rank = sum(p.numel() * p.element_size() for n, p in llm.model.named_parameters()
                       if not n.startswith("embed_tokens"))
        weight_bytes = per_rank * tp  # every rank holds an equal share of these (to a head)
        kv_per_token = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * cfg["head_dim"] * 2
        V = cfg["vocab_size"]
        res = {"tensor_parallel_size": tp, "peer_kernel": peer, "weight_bytes_read_per_step": weight_bytes,
               "tensor_parallel": llm.info()["tensor_parallel"]}
        for ctx in contexts:
            r, toks = decode(llm, 1, ctx, GEN, V)
            limit_s = (weight_bytes + kv_per_token * (ctx + GEN / 2)) / bw
            r["fraction_of_bandwidth_limit"] = r["tok_s"] * limit_s
            res[f"b1_ctx{ctx}"] = r
            res.setdefault("b1_tokens", toks)
            log(f"TP={tp} peer={peer} batch 1 at {ctx}: {r['tok_s']:.1f} tok/s, "
                f"{r['fraction_of_bandwidth_limit']:.1%} of limit")
        r, _ = decode(llm, 32, 512, 64, V)
        res["b32_ctx512"] = r
        log(f"TP={tp} peer={peer} batch 32: {r['tok_s']:.0f} tok/s")
        res["cuda_graph"] = llm.cuda_graph_report()
        return res
    finally:
        llm.close()
        del llm
        gc.collect()
        torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tensor-parallel-size", type=int, default=2, help="the largest TP size (GPUs used)")
    ap.add_argument("--sizes", default=None, help="TP sizes to compare, e.g. 1,2,4 (default: 1 and the largest)")
    ap.add_argument("--contexts", default="1024", help="batch-1 context lengths, e.g. 1024,16384")
    ap.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    ap.add_argument("--layers", type=int, default=None, help="fewer layers (a quick check run)")
    ap.add_argument("--out", default=".onecat/gpu_tp.json")
    args = ap.parse_args()
    world = args.tensor_parallel_size
    share = _share_device()
    gpus = 1 if share else world
    if torch.cuda.device_count() < gpus:
        sys.exit(f"--tensor-parallel-size {world} needs {world} GPUs; this host has {torch.cuda.device_count()} "
                 "(ONECAT_TP_SHARE_DEVICE=1 runs a check on one)")
    props = torch.cuda.get_device_properties(0)
    rec = {"benchmark": "gpu_tp", "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "measured_on": f"{gpus}x {props.name}", "versions": {"torch": torch.__version__, "cuda": torch.version.cuda},
           "weights": f"random fp16 ({args.shape} shape, load_format dummy): speed only",
           "check_run_only": ("ONECAT_TP_SHARE_DEVICE=1: every rank on one GPU, time-shared; the figures say "
                              "nothing about tensor-parallel speed") if share else None}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def save():
        out.write_text(json.dumps(rec, indent=2, default=str))

    bws = []
    for g in range(gpus):
        with torch.cuda.device(g):
            bws.append(ceilings()["copy_bandwidth_GBps"])
    rec["copy_bandwidth_GBps_per_gpu"] = bws
    save()
    sizes = sorted({int(x) for x in (args.sizes or f"1,{world}").split(",")})
    contexts = [int(x) for x in args.contexts.split(",")]
    if max(sizes) > world:
        sys.exit(f"--sizes {args.sizes} goes past --tensor-parallel-size {world}")
    rec["allreduce_us_per_call"] = {}
    for size in (s for s in sizes if s > 1):
        rec["allreduce_us_per_call"][f"tp{size}"] = allreduce_costs(size)
        log(f"all-reduce tp{size}", rec["allreduce_us_per_call"][f"tp{size}"])
        save()
    cfg = dict(SHAPES[args.shape])
    if args.layers:
        cfg["num_hidden_layers"] = args.layers
    arms = rec.setdefault("arms", {})
    plan = [(f"tp{t}_{kind}", t, kind == "peer") for t in sizes for kind in (("peer", "nccl") if t > 1 else ("",))]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_model_dir(Path(tmp), cfg)
        for name, tp, peer in plan:
            name = name.rstrip("_")
            bw = (sum(bws[:tp]) * 1e9) if not share else bws[0] * 1e9 * tp
            try:
                arms[name] = bench_arm(model_dir, cfg, tp, peer, bw, contexts)
            except Exception as e:  # one failed arm (e.g. 70B on one GPU) must not lose the others
                arms[name] = {"error": f"{type(e).__name__}: {str(e)[:400]}"}
            save()
    base = arms.get("tp1", {})
    keys = [f"b1_ctx{c}" for c in contexts] + ["b32_ctx512"]
    for name, arm in arms.items():
        if name != "tp1" and all(k in arm and k in base for k in keys):
            arm["speedup_vs_tp1"] = {k: arm[k]["tok_s"] / base[k]["tok_s"] for k in keys}
            arm["greedy_tokens_equal_tp1"] = arm.pop("b1_tokens") == base["b1_tokens"]
            row = rec["allreduce_us_per_call"][f"tp{arm['tensor_parallel_size']}"][str(8 << 10)]
            per_call = row["peer_kernel_graph_us"] if arm["peer_kernel"] else row.get("nccl_graph_us")
            first = keys[0]
            if per_call is not None:
                calls = 2 * cfg["num_hidden_layers"] + 1  # o_proj and down_proj per layer, the embedding
                arm["allreduce_share_of_b1_step"] = calls * per_call / 1e3 / arm[first]["step_ms"]
    base.pop("b1_tokens", None)
    save()
    log("wrote", out)
    print(json.dumps({k: {m: arm.get(m) for m in (*keys, "speedup_vs_tp1", "allreduce_share_of_b1_step", "error")}
                      for k, arm in arms.items()}, indent=1, default=str))


if __name__ == "__main__":
    main()
