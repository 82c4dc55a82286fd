"""Batch-1 GEMV on a CUDA GPU: onecat's Triton GEMV against cuBLAS for every projection of the 8B shapes.

    python benchmarks/gpu_gemv.py --out results.json [--sweep]

Each arm is timed inside a CUDA graph that calls it once per rotating copy of the weight (enough
copies that the L2 cache holds none of them between calls), so the figure is what a decode step
pays: DRAM streaming plus the launch and tail of each kernel. Arms per shape:
  cublas            F.linear on one fp16 row (what the engine used before)
  gemv              the Triton GEMV with the engine's default tile config
  (--sweep)         the Triton GEMV (plain and fused) over a grid of tile configs; the best is reported
and for the projections that the engine fuses with their neighbours, the separate kernels against
the fused GEMV:
  qkv:      add_rmsnorm kernel + cuBLAS             vs  GEMV[norm]
  gate_up:  add_rmsnorm + cuBLAS + silu_mul kernel  vs  GEMV[norm, glu]
Every Triton arm is checked against an fp32 reference first (relative max error < 1e-2).

With --rows 2,8,16 it also times calls of several rows (a batch-1 verify step's 1 + k rows), plain and
with the shape's fusion: cuBLAS, the GEMV with one program per row, and the GEMV whose programs walk every
row of their tile (triton_gemv.ROW_LOOP); both GEMV arms must give each row the bits a one-row call gives.
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import time

import torch
import torch.nn.functional as F

SHAPES = {  # name: (out_features N, in_features K, what the engine fuses into it)
    "llama3-8b.qkv": (6144, 4096, "norm"), "llama3-8b.o": (4096, 4096, None),
    "llama3-8b.gate_up": (28672, 4096, "norm+glu"), "llama3-8b.down": (4096, 14336, None),
    "llama3-8b.lm_head": (128256, 4096, None),
    "qwen3-8b.gate_up": (24576, 4096, "norm+glu"), "qwen3-8b.down": (4096, 12288, None),
    # the dense projections of the Qwen3-30B-A3B MoE shape (its experts run in triton_moe)
    "qwen3-30b-a3b.qkv": (5120, 2048, "norm"), "qwen3-30b-a3b.o": (2048, 4096, None),
    "qwen3-30b-a3b.router": (128, 2048, None), "qwen3-30b-a3b.lm_head": (151936, 2048, None),
}
L2_FLUSH_BYTES = 400 << 20


def log(*a):
    print(f"[{time.strftime('%H:%M:%S')}]", *a, flush=True)


def graph_time(calls, reps: int = 20) -> float:
    """Median seconds per call of `calls` (one per weight copy) replayed as one CUDA graph."""
    for c in calls:
        c()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            c()
    g.replay()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3 / len(calls))
    return sorted(times)[len(times) // 2]


def sweep_configs() -> list[tuple[int, int, int]]:
    """(BLOCK_N, BLOCK_K, num_warps) with 2K-16K weight elements per tile; 8 warps for the big tiles."""
    out = []
    for bk in (256, 512, 1024, 2048):
        for bn in (1, 2, 4, 8, 16):
            if 2048 <= bn * bk <= 16384:
                out += [(bn, bk, 4)] + ([(bn, bk, 8)] if bn * bk >= 8192 else [])
    return out


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref).abs().max() / ref.abs().max())


def bench_shape(name: str, n: int, k: int, fused: str | None, sweep: bool) -> dict:
    from onecat.engine.kernels import triton_fused as tf
    from onecat.engine.kernels import triton_gemv as tg

    dt = torch.float16
    copies = max(3, -(-L2_FLUSH_BYTES // (n * k * 2)))
    gen = torch.Generator(device="cuda").manual_seed(0)
    ws = [torch.randn(n, k, device="cuda", dtype=dt, generator=gen) * k ** -0.5 for _ in range(copies)]
    x = torch.randn(1, k, device="cuda", dtype=dt, generator=gen)
    ref = ws[0].float() @ x.float()[0]
    res = {"N": n, "K": k, "weight_MB": n * k * 2 / 1e6, "copies_in_graph": copies}

    def record(arm: str, calls, moved: int) -> float:
        t = graph_time(calls)
        res[arm] = {"us": round(t * 1e6, 2), "GBps": round(moved / t / 1e9, 1)}
        return t

    record("cublas", [lambda w=w: F.linear(x, w) for w in ws], n * k * 2)
    default = tg.default_config(n, k)
    err = rel_err(tg.gemv(x, ws[0]), ref)
    assert err < 1e-2, f"{name}: GEMV default config error {err}"
    record("gemv", [lambda w=w: tg.gemv(x, w) for w in ws], n * k * 2)
    res["gemv"].update(config=list(default), rel_err=err)
    if sweep:
        grid = {}
        for cfg in sweep_configs():
            err = rel_err(tg.gemv(x, ws[0], config=cfg), ref)
            assert err < 1e-2, f"{name}: config {cfg} error {err}"
            grid[str(cfg)] = round(graph_time([lambda w=w, c=cfg: tg.gemv(x, w, config=c) for w in ws]) * 1e6, 2)
        best = min(grid, key=grid.get)
        res["sweep_us"] = grid
        res["sweep_best"] = {"config": best, "us": grid[best], "GBps": round(n * k * 2 / grid[best] / 1e3, 1)}
    if fused:
        glu = fused == "norm+glu"
        r = torch.randn(1, k, device="cuda", dtype=dt, generator=gen)
        nw = torch.rand(k, device="cuda", dtype=dt, generator=gen) + 0.5
        normed, h = tf.add_rmsnorm(x, r, nw, 1e-5)
        ref = ws[0].float() @ normed.float()[0]
        if glu:
            ref = F.silu(ref[:n // 2]) * ref[n // 2:]
        y, hout = tg.gemv(x, ws[0], residual=r, norm_weight=nw, eps=1e-5, glu=glu)
        err = rel_err(y[0], ref)
        assert err < 1e-2 and torch.equal(hout, h), f"{name}: fused {fused} error {err}"

        def separate(w):
            y = F.linear(tf.add_rmsnorm(x, r, nw, 1e-5)[0], w)
            return tf.silu_mul(y) if glu else y

        record(f"separate[{fused}]", [lambda w=w: separate(w) for w in ws], n * k * 2)
        record(f"gemv[{fused}]", [lambda w=w: tg.gemv(x, w, residual=r, norm_weight=nw, eps=1e-5, glu=glu)
                                  for w in ws], n * k * 2)
        res[f"gemv[{fused}]"]["rel_err"] = err
        if sweep:
            grid = {str(cfg): round(graph_time([lambda w=w, c=cfg: tg.gemv(x, w, residual=r, norm_weight=nw, eps=1e-5,
                                                                        glu=glu, config=c) for w in ws]) * 1e6, 2)
                    for cfg in sweep_configs()}
            best = min(grid, key=grid.get)
            res[f"sweep_us[{fused}]"] = grid
            res[f"sweep_best[{fused}]"] = {"config": best, "us": grid[best],
                                           "GBps": round(n * k * 2 / grid[best] / 1e3, 1)}
    del ws
    torch.cuda.empty_cache()
    return res


def bench_rows(n: int, k: int, fused: str | None, rows: list[int]) -> dict:
    """Calls of several rows: per row count, us of cuBLAS, of both GEMV launch shapes (and the fused
    variants), each checked bit for bit against one-row calls."""
    from onecat.engine.kernels import triton_gemv as tg

    dt = torch.float16
    copies = max(3, -(-L2_FLUSH_BYTES // (n * k * 2)))
    gen = torch.Generator(device="cuda").manual_seed(1)
    ws = [torch.randn(n, k, device="cuda", dtype=dt, generator=gen) * k ** -0.5 for _ in range(copies)]
    variants = [("plain", {})]
    if fused:
        r = torch.randn(max(rows), k, device="cuda", dtype=dt, generator=gen)
        nw = torch.rand(k, device="cuda", dtype=dt, generator=gen) + 0.5
        variants.append((fused, {"norm_weight": nw, "eps": 1e-5, "glu": fused == "norm+glu", "residual": r}))
    out = {}
    for m in rows:
        x = torch.randn(m, k, device="cuda", dtype=dt, generator=gen)
        res = out[m] = {"cublas_us": round(graph_time([lambda w=w: F.linear(x, w) for w in ws]) * 1e6, 2)}
        for label, kw in variants:
            kw = {**kw, "residual": kw["residual"][:m]} if "residual" in kw else kw
            first = lambda y: y[0] if isinstance(y, tuple) else y  # noqa: E731
            single = torch.cat([first(tg.gemv(x[i:i + 1], ws[0], **{**kw, "residual": kw["residual"][i:i + 1]}
                                               if "residual" in kw else kw)) for i in range(m)])
            for loop in (False, True):
                tg.ROW_LOOP = loop
                arm = f"{'row_loop' if loop else 'row_programs'}[{label}]"
                same = torch.equal(first(tg.gemv(x, ws[0], **kw)), single)
                res[arm] = {"us": round(graph_time([lambda w=w: tg.gemv(x, w, **kw) for w in ws]) * 1e6, 2),
                            "bits_as_one_row_calls": same}
        tg.ROW_LOOP = True
    del ws
    torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=".onecat/gpu_gemv.json")
    ap.add_argument("--sweep", action="store_true", help="also time a grid of tile configs per shape")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--rows", default="", help="also time calls of these row counts (e.g. 2,8,16)")
    ap.add_argument("--pdl", choices=("on", "off"), default="on",
                    help="programmatic dependent launch between the timed calls (SM90+; engine/kernels/pdl.py)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_gemv.py needs a CUDA GPU (none visible to torch)")
    import triton

    from onecat.engine.kernels import pdl

    pdl.ENABLED = args.pdl == "on"
    record = {"machine": {"gpu": torch.cuda.get_device_name(), "host": platform.node(),
                          "torch": torch.__version__, "cuda": torch.version.cuda, "triton": triton.__version__},
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "note": "random fp16 weights; batch-1 (one row); CUDA-graph timing over rotating weight copies",
              "pdl": pdl.options(torch.device("cuda"))["PDL"],
              "shapes": {}}
    for name in args.shapes.split(","):
        n, k, fused = SHAPES[name]
        log(name, n, k)
        r = record["shapes"][name] = bench_shape(name, n, k, fused, args.sweep)
        if args.rows:
            r["rows"] = bench_rows(n, k, fused, [int(m) for m in args.rows.split(",")])
            for m, arms in r["rows"].items():
                log(f"    {m} rows:", "  ".join(f"{a} {v['us'] if isinstance(v, dict) else v}us"
                                               + ("" if not isinstance(v, dict) or v.get("bits_as_one_row_calls", True)
                                                  else " BITS DIFFER") for a, v in arms.items()))
        arms = {a: v for a, v in r.items() if isinstance(v, dict) and "us" in v}
        log("   ", "  ".join(f"{a} {v['us']}us {v['GBps']}GB/s" for a, v in arms.items()))
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
    log("wrote", args.out)


if __name__ == "__main__":
    main()
