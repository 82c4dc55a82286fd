"""The paged decode attention (engine/kernels/triton_paged_decode.py: split + merge kernels) alone, at long contexts,
in the tilings it can launch: where the 16K-context decode step loses to the 1K one.

    python benchmarks/gpu_paged_decode.py --out results.json [--contexts 1024,4096,16384,32768] [--batch 1,8]

At the Llama-3-8B shape's attention (32 query heads, 8 KV heads, head size 128, bf16 KV) a decode step of `batch`
sequences of `context` tokens each. Per variant (the wide one-stage tile; 64-token tiles in two stages; partitions of
128, 256 or 512 tokens at every length, or 128 up to tpd.LONG_FROM tokens and 512 past it, as
ONECAT_PAGED_LONG_PARTITION=1 launches it; wide128 is the default) one CUDA graph runs the step's attention for as
many layers as it takes to read ~512 MB of KV (each layer its own cache, so L2 does not hold them), and the figure is
per layer: microseconds, the KV bytes it must read, and their share of the card's copy rate (a device-to-device copy
of 1 GiB). Every variant is first checked against the first (largest difference of the outputs): another tile or
partition size sums the softmax in another order, so small differences are expected. Off a GPU (`--device cpu` under
Triton's interpreter: tests/test_gpu_paged_decode_bench.py) only that check runs.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import platform

import torch
from gpu_gemv import graph_time

# (label, WIDE_TILE, PARTITION, LONG_PARTITION): the wide tile needs the whole partition in one stage, so its
# partition stays at 128 tokens (a long sequence's LONG_PARTITION-token partitions walk several such tiles);
# LONG_PARTITION = PARTITION: every length in the one partition size
VARIANTS = (("wide128", True, 128, 128), ("wide128_long512", True, 128, 512), ("tiles64x2_128", False, 128, 128),
            ("tiles64x2_256", False, 256, 256), ("tiles64x2_512", False, 512, 512),
            ("tiles64x2_128_long512", False, 128, 512))
PAGE = 16
TARGET_BYTES = 512 << 20  # KV read by one graph: enough layers that L2 holds none of it


def log(*a) -> None:
    print(f"[{datetime.datetime.now():%H:%M:%S}]", *a, flush=True)


def layer_caches(layers: int, batch: int, context: int, kv_heads: int, head_dim: int, dtype, device):
    """`layers` caches holding `batch` sequences of `context` tokens in consecutive blocks, and the step's tables."""
    from onecat.engine.cache.kv import LayerKVCache

    blocks = batch * -(-context // PAGE)
    caches = []
    for _ in range(layers):
        k = torch.randn(blocks + 1, PAGE, kv_heads, head_dim, device=device).to(dtype)
        v = torch.randn(blocks + 1, PAGE, kv_heads, head_dim, device=device).to(dtype)
        caches.append(LayerKVCache(k, v, None, None, None))
    per_seq = -(-context // PAGE)
    tables = (torch.arange(blocks, device=device, dtype=torch.int32) + 1).view(batch, per_seq)
    lens = torch.full((batch,), context, device=device, dtype=torch.int32)
    return caches, tables, lens


@contextlib.contextmanager
def tiling(variant):
    """The paged decode launched with `variant`'s tile and partition while inside (module settings it reads at each
    launch; a CUDA graph keeps what was launched at its capture)."""
    from onecat.engine.kernels import triton_paged_decode as tpd

    saved = tpd.WIDE_TILE, tpd.PARTITION, tpd.LONG_PARTITION
    tpd.WIDE_TILE, tpd.PARTITION, tpd.LONG_PARTITION = variant[1:]
    try:
        yield
    finally:
        tpd.WIDE_TILE, tpd.PARTITION, tpd.LONG_PARTITION = saved


def bench(batch: int, context: int, heads: tuple[int, int, int], dtype, device: str, rate: float | None) -> dict:
    hq, hkv, d = heads
    per_layer = batch * context * hkv * d * 2 * torch.finfo(dtype).bits // 8
    layers = max(2, min(64, -(-TARGET_BYTES // per_layer))) if device == "cuda" else 2
    caches, tables, lens = layer_caches(layers, batch, context, hkv, d, dtype, device)
    q = torch.randn(batch, hq, d, device=device).to(dtype)
    outs = {v[0]: [torch.empty_like(q) for _ in caches] for v in VARIANTS}
    result = {"batch": batch, "context": context, "layers_per_graph": layers, "kv_bytes_per_layer": per_layer,
              "variants": {}}
    reference = None
    for variant in VARIANTS:
        from onecat.engine.kernels import triton_paged_decode as tpd

        calls = [lambda c=c, o=o: tpd.paged_decode(o, q, c, tables, lens, context, d ** -0.5)
                 for c, o in zip(caches, outs[variant[0]])]
        with tiling(variant):
            for call in calls:
                call()
            seconds = graph_time(calls) if device == "cuda" else None
        got = outs[variant[0]][0].float()
        reference = got if reference is None else reference
        entry = {"max_abs_diff_vs_default": float((got - reference).abs().max())}
        if seconds is not None:
            entry.update(us_per_layer=round(seconds * 1e6, 2), GBps=round(per_layer / seconds / 1e9, 1),
                         of_copy_rate=round(per_layer / seconds / rate, 3))
        result["variants"][variant[0]] = entry
        log(f"batch {batch} context {context} {variant[0]}: {entry}")
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=".onecat/gpu_paged_decode.json")
    ap.add_argument("--contexts", default="1024,4096,16384,32768")
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--heads", default="32,8,128", help="query heads, KV heads, head size")
    ap.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_paged_decode.py needs a CUDA GPU (none visible to torch) to time anything")
    import triton

    torch.set_grad_enabled(False)
    torch.manual_seed(0)
    heads = tuple(int(h) for h in args.heads.split(","))
    rate = None
    if args.device == "cuda":
        from gpu_gdn_step import copy_rate

        rate = copy_rate()
    record = {"machine": {"gpu": torch.cuda.get_device_name() if args.device == "cuda" else platform.processor(),
                          "host": platform.node(), "torch": torch.__version__, "cuda": torch.version.cuda,
                          "triton": triton.__version__},
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "heads": heads, "dtype": args.dtype, "page": PAGE, "timed": args.device == "cuda",
              "copy_rate_GBps": None if rate is None else round(rate / 1e9, 1), "results": []}
    for batch in (int(b) for b in args.batch.split(",")):
        for context in (int(c) for c in args.contexts.split(",")):
            record["results"].append(bench(batch, context, heads, getattr(torch, args.dtype), args.device, rate))
            with open(args.out, "w") as f:
                json.dump(record, f, indent=1)
    log("wrote", args.out)


if __name__ == "__main__":
    main()
