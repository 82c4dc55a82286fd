"""Packed 4-bit (W4A16) projections on a CUDA GPU against fp16: the 8B projections at 1 and 8 rows, and the
dense path at 32 rows.

    python benchmarks/gpu_w4a16.py --out benchmarks/results/quant_h200.json [--sweep] [--shapes qkv,down]

Every figure is timed inside a CUDA graph that calls the arm once per rotating copy of its weight (enough
copies that the L2 cache holds none of them between calls), median of 20 replays, per call. Arms:
  cublas       F.linear on fp16 weights
  gemv_fp16    onecat's fp16 Triton GEMV (engine/kernels/triton_gemv.py)
  w4a16        the W4A16 GEMV with its default tile config (and, with --sweep, the best of a grid)
  w4a16_dense  (8 rows) the W4A16 layer's dense path: dequantize the weight, then cuBLAS
At 32 rows: cuBLAS fp16 against the W4A16 layer's dense path, dequantizing the whole weight per call
or a tile of output rows at a time. "layer" sums the four projections of one decoder layer (qkv, o,
gate_up, down): bytes over time, as a decode step sees them.
Bandwidth counts the bytes a call must read: fp16 weights (2 B each), or codes + scales + zeros, plus x.
The copy limit is a large device-to-device copy timed in the same run (read + written bytes / time).
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform

import torch
import torch.nn.functional as F
from gpu_gemv import graph_time, log  # same timing method as the fp16 GEMV benchmark

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096)}
L2_FLUSH_BYTES = 400 << 20
# rows: [(BLOCK_N, BLOCK_KW, num_warps, SPLIT) FMA tiles | ("dot", BLOCK_N, num_warps, num_stages, SPLIT) tensor
# cores]; configs whose BLOCK_KW * SPLIT does not divide the row's words are skipped.
SWEEP = {1: [(16, 128, 2, 1), (16, 512, 8, 1), (16, 256, 4, 7)],
         8: [("dot", 64, 4, 3, 2), ("dot", 32, 4, 3, 4), ("dot", 64, 4, 3, 1), ("dot", 128, 8, 3, 2)]}
# earlier grids (results in quant_h200.json's history): one row (16,128,2,2|4), (8,128,2,4|14), (16,128,2,7|14);
# 8 rows FMA (8,128,2,1), ("dot",16|32,4,3,1|4), ("dot",32,4,4,2)


def fits(cfg: tuple, k: int, group: int = 128) -> bool:
    if cfg[0] == "dot":
        return (k // group) % cfg[-1] == 0
    return (k // 8) % (cfg[1] * (cfg[3] if len(cfg) > 3 else 1)) == 0


def _compile_one(task) -> str:
    """Compile (by running once, small N) one W4A16 config; runs in a worker process."""
    k, m, cfg = task
    from onecat.engine.kernels import triton_w4a16 as kw

    q = torch.zeros(256, k // 8, dtype=torch.int32, device="cuda")
    sz = torch.ones(256, k // 128, 2, dtype=torch.float16, device="cuda")
    kw.w4a16_gemv(torch.ones(m, k, dtype=torch.float16, device="cuda"), q, sz, 128, config=cfg)
    torch.cuda.synchronize()
    return f"{k} {m} {cfg}"


def precompile(tasks: list, workers: int = 14) -> None:
    """Triton compiles each config once into its disk cache, many at a time (the timed runs then load them)."""
    import concurrent.futures as cf
    import multiprocessing as mp

    with cf.ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as ex:
        for done in ex.map(_compile_one, tasks):
            log("compiled", done)


def w4a16_tasks(shapes: list[str], sweep: bool) -> list:
    tasks = []
    for name in shapes:
        n, k = SHAPES[name]
        from onecat.engine.kernels.triton_w4a16 import default_config

        for m in (1, 8):
            cfgs = [default_config(n, k, m, 90)] + (SWEEP[m] if sweep else [])
            tasks += [(k, m, c) for c in dict.fromkeys(cfgs) if fits(c, k)]
    return sorted(set(tasks), key=str)


def copy_limit_gbps(nbytes: int = 4 << 30) -> float:
    """Device-to-device copy bandwidth (bytes read + written per second), median of 20."""
    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    b.copy_(a)
    times = []
    for _ in range(20):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    del a, b
    torch.cuda.empty_cache()
    return 2 * nbytes / sorted(times)[10] / 1e9


def random_packed(n: int, k: int, group: int, gen):
    from onecat.engine.quant.w4a16.layout import scale_zero_pairs

    q = torch.randint(-2**31, 2**31 - 1, (n, k // 8), dtype=torch.int32, device="cuda", generator=gen)
    s = (torch.rand(n, k // group, device="cuda", generator=gen) * 0.02 + 0.001).half()
    z = torch.randint(0, 16, (n, k // group), device="cuda", generator=gen).half()
    return q, s, z, scale_zero_pairs(s, z)


def bench_shape(name: str, n: int, k: int, sweep: bool, copy_gbps: float, group: int = 128) -> dict:
    from onecat.engine.kernels import triton_gemv as tg
    from onecat.engine.kernels import triton_w4a16 as kw
    from onecat.engine.quant.w4a16.layout import W4A16Weight, dequantize
    from onecat.engine.quant.w4a16.linear import W4A16Linear

    gen = torch.Generator(device="cuda").manual_seed(0)
    fp16_bytes = n * k * 2
    w4_bytes = n * k // 2 + 2 * 2 * n * (k // group)
    c16 = max(3, -(-L2_FLUSH_BYTES // fp16_bytes))
    c4 = max(3, -(-L2_FLUSH_BYTES // w4_bytes))
    ws = [torch.randn(n, k, device="cuda", dtype=torch.float16, generator=gen) * k ** -0.5 for _ in range(c16)]
    ps = [random_packed(n, k, group, gen) for _ in range(c4)]
    dense0 = dequantize(W4A16Weight(*ps[0][:3], group))
    res = {"N": n, "K": k, "group": group, "fp16_weight_MB": fp16_bytes / 1e6, "w4_weight_MB": w4_bytes / 1e6,
           "copies_fp16": c16, "copies_w4": c4}

    def arm(t: float, moved: int) -> dict:
        gbps = moved / t / 1e9
        return {"us": round(t * 1e6, 2), "GBps": round(gbps, 1), "frac_copy_limit": round(gbps / copy_gbps, 3)}

    for m in (1, 8):
        x = torch.randn(m, k, device="cuda", dtype=torch.float16, generator=gen)
        xb = m * k * 2
        ref = x.double() @ dense0.double().t()
        y = kw.w4a16_gemv(x, ps[0][0], ps[0][3], group)
        rel = float((y.double() - ref).abs().max() / ref.abs().max())
        assert rel < 1e-2, f"{name} M={m}: W4A16 GEMV relative error {rel}"
        r = res[f"M{m}"] = {}
        r["cublas"] = arm(graph_time([lambda w=w: F.linear(x, w) for w in ws]), fp16_bytes + xb)
        r["gemv_fp16"] = arm(graph_time([lambda w=w: tg.gemv(x, w) for w in ws]), fp16_bytes + xb)
        r["w4a16"] = arm(graph_time([lambda p=p: kw.w4a16_gemv(x, p[0], p[3], group) for p in ps]), w4_bytes + xb)
        r["w4a16"].update(config=list(kw.default_config(n, k, m)), rel_err=rel)
        if m > 1:
            layers = [W4A16Linear(W4A16Weight(*p[:3], group)) for p in ps]
            r["w4a16_dense"] = arm(graph_time([lambda lay=lay: lay._dense(x) for lay in layers]), w4_bytes + xb)
        if sweep:
            grid = {}
            for cfg in SWEEP[m]:
                if not fits(cfg, k):
                    continue
                yc = kw.w4a16_gemv(x, ps[0][0], ps[0][3], group, config=cfg)
                assert float((yc.double() - ref).abs().max() / ref.abs().max()) < 1e-2, (name, m, cfg)
                grid[str(cfg)] = round(graph_time([lambda p=p, c=cfg: kw.w4a16_gemv(x, p[0], p[3], group, config=c)
                                                   for p in ps]) * 1e6, 2)
            best = min(grid, key=grid.get)
            r["w4a16_sweep_us"] = grid
            r["w4a16_best"] = {"config": best, **arm(grid[best] / 1e6, w4_bytes + xb)}
        best_fp16 = min(r["cublas"]["us"], r["gemv_fp16"]["us"])
        r["speedup_vs_best_fp16"] = round(best_fp16 / r["w4a16"]["us"], 2)
        log(f"  {name} M={m}: " + "  ".join(f"{a} {v['us']}us {v['GBps']}GB/s {v['frac_copy_limit']:.0%}"
                                            for a, v in r.items() if isinstance(v, dict) and "us" in v))
    if name != "lm_head":  # 32 rows: dense path, whole weight vs row tiles
        x = torch.randn(32, k, device="cuda", dtype=torch.float16, generator=gen)
        r = res["M32"] = {"cublas": {"us": round(graph_time([lambda w=w: F.linear(x, w) for w in ws]) * 1e6, 2)}}
        for tile in (0,):
            layers = [W4A16Linear(W4A16Weight(*p[:3], group), dense_tile_rows=tile) for p in ps[:3]]
            r[f"w4a16_dense_tile{tile}" if tile else "w4a16_dense_whole"] = {
                "us": round(graph_time([lambda lay=lay: lay(x) for lay in layers]) * 1e6, 2)}
        log(f"  {name} M=32: " + "  ".join(f"{a} {v['us']}us" for a, v in r.items()))
    del ws, ps
    torch.cuda.empty_cache()
    return res


def layer_sum(shapes: list[dict], copy_gbps: float) -> dict:
    """One decoder layer's four projections: summed bytes over summed per-call time, per arm and row count."""
    out = {}
    for m in (1, 8):
        arms = {}
        for a in ("cublas", "gemv_fp16", "w4a16", "w4a16_best"):
            if all(a in r[f"M{m}"] for r in shapes):
                t = sum(r[f"M{m}"][a]["us"] for r in shapes) / 1e6
                b = sum(r[f"M{m}"][a]["GBps"] * r[f"M{m}"][a]["us"] / 1e6 for r in shapes) * 1e9
                arms[a] = {"us": round(t * 1e6, 2), "GBps": round(b / t / 1e9, 1),
                           "frac_copy_limit": round(b / t / 1e9 / copy_gbps, 3)}
        best16 = min(arms["cublas"]["us"], arms["gemv_fp16"]["us"])
        arms["speedup_vs_best_fp16"] = round(best16 / arms["w4a16"]["us"], 2)
        out[f"M{m}"] = arms
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=".onecat/quant_h200.json")
    ap.add_argument("--sweep", action="store_true", help="also time a grid of W4A16 tile configs per shape")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--precompile", type=int, default=0, help="compile the configs first in this many processes")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_w4a16.py needs a CUDA GPU (none visible to torch)")
    import triton

    if args.precompile:
        precompile(w4a16_tasks(args.shapes.split(","), args.sweep), args.precompile)
    copy_gbps = copy_limit_gbps()
    log(f"copy limit {copy_gbps:.0f} GB/s")
    record = {"machine": {"gpu": torch.cuda.get_device_name(), "host": platform.node(),
                          "torch": torch.__version__, "cuda": torch.version.cuda, "triton": triton.__version__},
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "label": "measured", "note": "random fp16 weights and random packed 4-bit weights (group 128); "
              "CUDA-graph timing over rotating weight copies, median of 20 replays",
              "copy_limit_GBps": round(copy_gbps, 1), "shapes": {}}
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        log(name, n, k)
        record["shapes"][name] = bench_shape(name, n, k, args.sweep, copy_gbps)
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
    layer = [record["shapes"][s] for s in ("qkv", "o", "gate_up", "down") if s in record["shapes"]]
    if len(layer) == 4:
        record["layer"] = layer_sum(layer, copy_gbps)
        log("layer (qkv+o+gate_up+down):", json.dumps(record["layer"]))
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
    log("wrote", args.out)


if __name__ == "__main__":
    main()
