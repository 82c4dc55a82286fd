"""Where a DFlash drafter's round goes on a CUDA GPU, and what its matmuls would cost alone: the random drafter of
a target shape's published DFlash shape (engine/speculative/random_drafter.py; the 8B shape: width 4096, five
layers, block 16), its block forward through the fused path (dflash_fused.py) at one request, the target's LM
head over the block's drafts, and the context projection of a verify step's rows.

    python benchmarks/gpu_drafter_block.py --out results.json [--shape llama3-8b] [--context 512]

Why: the 8B rounds' profile puts the drafter at ~1.8 ms of device time a round where its weights need ~1.0 ms at
the copy rate, and its 16-row GEMMs inside the round read at ~2 TB/s where the same shapes timed alone read at
~2.9. Every arm is a CUDA graph replayed with CUDA events (median of REPS), so it is what a round pays:
  block_graph_us      the block forward (5 layers, final norm): the matmuls by the engine's choice
  head_graph_us       the LM head over the drafts (block - 1 rows) and their argmax
  context_graph_us    fc + hidden_norm + every layer's K/V projection, norm and RoPE over the verify rows
  round_graph_us      the three in one graph, as a round runs them
  *_sdpa              the same with the block's attention through scaled_dot_product_attention over the
                      concatenated context and block (ONECAT_DRAFTER_BLOCK_ATTENTION=0)
  *_dense_rows        the same with dense_rows.DENSE_ROWS_GEMV on (the tensor-core rows GEMV for 2-16 rows)
and alone, per projection at the block's row count (cuBLAS in a graph over rotating weight copies, cold):
  alone_cublas_us, and the sum over a round's calls; the weight bytes a round reads and the device's copy rate
(a 2 GiB device-to-device copy), so `round_us / bytes_us` is how far the round is from its reads. With
--profile, a torch.profiler table of one round's kernels (graph replays: names and device time).
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from gpu_gemv import graph_time

REPS = 50


def log(*a) -> None:
    print(f"[{time.strftime('%H:%M:%S')}]", *a, flush=True)


def graph_us(fn, reps: int = REPS) -> float:
    """Median microseconds of one replay of a CUDA graph of fn (gpu_gemv.graph_time: warmed up eagerly first)."""
    return round(graph_time([fn], reps) * 1e6, 1)


def copy_rate_GBps() -> float:
    src = torch.empty(1 << 30, dtype=torch.float16, device="cuda")
    dst = torch.empty_like(src)
    us = graph_us(lambda: dst.copy_(src), reps=10)
    return round(2 * src.numel() * 2 / us / 1e3, 1)


def alone_cublas_us(n: int, k: int, rows: int, dtype: torch.dtype) -> float:
    """F.linear of `rows` rows on an [n, k] weight, cold (rotating copies past the L2)."""
    copies = max(3, -(-(400 << 20) // (n * k * 2)))
    ws = [torch.randn(n, k, device="cuda", dtype=dtype) for _ in range(copies)]
    x = torch.randn(rows, k, device="cuda", dtype=dtype)
    return round(graph_us(lambda: [F.linear(x, w) for w in ws]) / copies, 1)


def build(shape: str, block: int, context: int, dtype: torch.dtype):
    from onecat.engine.config import ModelConfig
    from onecat.engine.random_models import shape_config
    from onecat.engine.speculative.dflash_model import load_drafter
    from onecat.engine.speculative.random_drafter import random_dflash_drafter
    from onecat.engine.worker.fused_kernels import enable_fused_kernels

    cfg = ModelConfig.from_hf(shape_config(shape))
    folder = random_dflash_drafter(cfg, block)
    target = SimpleNamespace(model_config=cfg, max_model_len=context + 4 * block)
    dev = torch.device("cuda")
    drafter = load_drafter(folder, target, dtype, dev)
    enable_fused_kernels(drafter, dev, dtype, True)
    from onecat.engine.layers.linear import Linear

    head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False).to(dev, dtype)
    torch.nn.init.normal_(head.weight, std=0.02)
    head.use_fused = True
    return cfg, drafter, head


@torch.no_grad()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="llama3-8b")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--verify-rows", type=int, default=16, help="rows of the context projection (a verify step's)")
    ap.add_argument("--dtype", default="float16", choices=("float16", "bfloat16"))
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    from onecat.engine.core.sampler import greedy_on_device
    from onecat.engine.kernels import dense_rows
    from onecat.engine.speculative import dflash_fused
    from onecat.engine.speculative.dflash_fused import forward_fused

    dtype = getattr(torch, args.dtype)
    log("building the drafter", args.shape)
    cfg, drafter, head = build(args.shape, args.block, args.context, dtype)
    H, B, C = cfg.hidden_size, args.block, args.context
    attn = drafter.layers[0].self_attn
    gen = torch.Generator(device="cuda").manual_seed(0)
    block_embeds = torch.randn(1, B, H, device="cuda", dtype=dtype, generator=gen)
    block_pos = torch.arange(C, C + B, device="cuda").unsqueeze(0)
    ctx = drafter.context(torch.randn(1, C, len(drafter.target_layer_ids) * H, device="cuda", dtype=dtype,
                                      generator=gen))
    layer_kv = drafter.context_kv(ctx, torch.arange(C, device="cuda").unsqueeze(0))
    ctx_len = torch.tensor([C], device="cuda")
    feats = torch.randn(1, args.verify_rows, len(drafter.target_layer_ids) * H, device="cuda", dtype=dtype,
                        generator=gen)
    feat_pos = torch.arange(C, C + args.verify_rows, device="cuda").unsqueeze(0)

    def block_fn():
        return forward_fused(drafter, block_embeds, block_pos, layer_kv, ctx_len)

    def head_fn(h=None):
        h = block_fn() if h is None else h
        return greedy_on_device(head(h[0, 1:]))

    def context_fn():
        return drafter.context_kv(drafter.context(feats), feat_pos)

    def round_fn():
        context_fn()
        return head_fn(block_fn())

    h_fixed = block_fn()
    res: dict = {}
    for tag, dense, attention in (("", False, True), ("_sdpa", False, False), ("_dense_rows", True, True)):
        dense_rows.DENSE_ROWS_GEMV = dense
        dflash_fused.BLOCK_ATTENTION = attention
        res["block_graph_us" + tag] = graph_us(block_fn)
        res["head_graph_us" + tag] = graph_us(lambda: head_fn(h_fixed))
        res["context_graph_us" + tag] = graph_us(context_fn)
        res["round_graph_us" + tag] = graph_us(round_fn)
        log(tag or "default", {k: v for k, v in res.items() if k.endswith("_us" + tag)})
    dense_rows.DENSE_ROWS_GEMV = False
    dflash_fused.BLOCK_ATTENTION = True
    nq, nkv, hd, inter = attn.nh, attn.nkv, attn.hd, cfg.intermediate_size
    L = len(drafter.layers)
    calls = {  # name: (N, K, rows, calls a round)
        "qkv": ((nq + 2 * nkv) * hd, H, B, L), "o": (H, nq * hd, B, L), "gate_up": (2 * inter, H, B, L),
        "down": (H, inter, B, L), "lm_head": (cfg.vocab_size, H, B - 1, 1),
        "fc": (H, len(drafter.target_layer_ids) * H, args.verify_rows, 1),
        "context_kv": (L * 2 * nkv * hd, H, args.verify_rows, 1)}
    alone = {name: alone_cublas_us(n, k, rows, dtype) for name, (n, k, rows, _) in calls.items()}
    bytes_round = sum(n * k * 2 * c for n, k, _, c in calls.values())
    rate = copy_rate_GBps()
    res.update(alone_cublas_us=alone, alone_cublas_round_us=round(sum(alone[n] * c[3] for n, c in calls.items()), 1),
               weight_bytes_round=bytes_round, copy_rate_GBps=rate,
               bytes_us=round(bytes_round / rate / 1e3, 1))
    res["round_over_bytes"] = round(res["round_graph_us"] / res["bytes_us"], 2)
    for tag in ("_sdpa", "_dense_rows"):
        res["round_over_bytes" + tag] = round(res["round_graph_us" + tag] / res["bytes_us"], 2)
    log("alone", alone, "round bytes", bytes_round, "copy rate", rate)
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            round_fn()
        g.replay()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                g.replay()
            torch.cuda.synchronize()
        kernels: dict[str, list[float]] = {}
        for e in prof.events():
            if e.device_type.name == "CUDA" and e.device_time > 0:
                kernels.setdefault(e.name[:90], []).append(e.device_time)
        res["profile_round_kernels_us"] = {k: [len(v) // 10, round(sum(v) / 10, 1)] for k, v in sorted(
            kernels.items(), key=lambda kv: -sum(kv[1]))[:40]}
    record = {"benchmark": "gpu_drafter_block", "started": datetime.datetime.now(datetime.timezone.utc).isoformat(
        timespec="seconds"), "device": torch.cuda.get_device_name(), "torch": torch.__version__,
        "cuda": torch.version.cuda, "host": platform.node(), "shape": args.shape, "block": B, "context": C,
        "verify_rows": args.verify_rows, "dtype": str(dtype), "results": res}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    log("wrote", args.out)


if __name__ == "__main__":
    main()
