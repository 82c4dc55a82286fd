"""Packed FP4 (NVFP4, MXFP4) projections on a CUDA GPU against fp16: the 8B projections at 1 and 8 rows.

    python benchmarks/gpu_fp4.py --out benchmarks/results/quant_h200_fp4.json [--sweep] [--precompile 14]

Same timing method as gpu_w4a16.py (CUDA graph over rotating weight copies, median of 20 replays, per call);
random codes and scales. Bandwidth counts the packed bytes a call reads (codes, block-scale bytes, NVFP4's
per-row global scales) plus x; the copy limit is a device-to-device copy timed in the same run.
"""
from __future__ import annotations

import argparse
import datetime
import json

import torch
import torch.nn.functional as F
from gpu_gemv import graph_time, log
from gpu_w4a16 import L2_FLUSH_BYTES, SHAPES, copy_limit_gbps

FORMATS = ("nvfp4", "mxfp4")
SWEEP = {1: [(16, 128, 2, 1), (16, 128, 2, 2), (16, 128, 2, 4), (8, 128, 2, 2), (16, 256, 4, 1), (32, 128, 4, 2),
             (16, 128, 2, 7)],
         8: [(8, 128, 4, 1), ("dot", 16, 4, 3, 1), ("dot", 32, 4, 3, 1), ("dot", 32, 4, 3, 2), ("dot", 64, 4, 3, 1),
             ("dot", 64, 8, 3, 1), ("dot", 16, 4, 3, 2)]}


def fits(cfg, k: int) -> bool:
    if cfg[0] == "dot":
        return k % (128 * cfg[-1]) == 0
    return (k // 8) % (cfg[1] * cfg[3]) == 0


def random_fp4(fmt: str, n: int, k: int, gen):
    from onecat.engine.quant.fp4.layout import FP4Weight

    q = torch.randint(-2**31, 2**31 - 1, (n, k // 8), dtype=torch.int32, device="cuda", generator=gen)
    if fmt == "nvfp4":
        s = (torch.rand(n, k // 16, device="cuda", generator=gen) * 4 + 0.1).to(torch.float8_e4m3fn).view(torch.uint8)
        return FP4Weight(q, s, torch.full((n,), 0.003, device="cuda"), fmt)
    s = torch.randint(118, 126, (n, k // 32), dtype=torch.uint8, device="cuda", generator=gen)
    return FP4Weight(q, s, None, fmt)


def _compile_one(task) -> str:
    fmt, k, m, cfg = task
    from onecat.engine.quant.fp4.linear import fp4_gemv

    gen = torch.Generator(device="cuda").manual_seed(0)
    fp4_gemv(torch.ones(m, k, dtype=torch.float16, device="cuda"), random_fp4(fmt, 256, k, gen), cfg)
    torch.cuda.synchronize()
    return f"{fmt} {k} {m} {cfg}"


def tasks(shapes, sweep: bool) -> list:
    from onecat.engine.quant.fp4.layout import FP4_BLOCKS
    from onecat.engine.quant.fp4.linear import default_config

    out = set()
    for fmt in FORMATS:
        for name in shapes:
            n, k = SHAPES[name]
            for m in (1, 8):
                for c in [default_config(n, k, m, FP4_BLOCKS[fmt], 90)] + (SWEEP[m] if sweep else []):
                    if fits(c, k):
                        out.add((fmt, k, m, c))
    return sorted(out, key=str)


def bench(fmt: str, name: str, n: int, k: int, sweep: bool, copy_gbps: float) -> dict:
    from onecat.engine.quant.fp4.layout import FP4_BLOCKS, dequantize
    from onecat.engine.quant.fp4.linear import default_config, fp4_gemv

    gen = torch.Generator(device="cuda").manual_seed(1)
    ws = random_fp4(fmt, n, k, gen)
    nbytes = ws.nbytes()
    copies = [ws] + [random_fp4(fmt, n, k, gen) for _ in range(max(2, -(-L2_FLUSH_BYTES // nbytes)) - 1)]
    c16 = max(3, -(-L2_FLUSH_BYTES // (n * k * 2)))
    w16 = [torch.randn(n, k, device="cuda", dtype=torch.float16, generator=gen) * k ** -0.5 for _ in range(c16)]
    dense = dequantize(ws).double()
    res = {"N": n, "K": k, "fp4_weight_MB": nbytes / 1e6, "copies": len(copies)}

    def arm(t: float, moved: int) -> dict:
        return {"us": round(t * 1e6, 2), "GBps": round(moved / t / 1e9, 1),
                "frac_copy_limit": round(moved / t / 1e9 / copy_gbps, 3)}

    for m in (1, 8):
        x = torch.randn(m, k, device="cuda", dtype=torch.float16, generator=gen) * 0.05
        ref = x.double() @ dense.t()
        rel = float((fp4_gemv(x, ws).double() - ref).abs().max() / ref.abs().max())
        assert rel < 1e-2, f"{fmt} {name} M={m}: relative error {rel}"
        r = res[f"M{m}"] = {"cublas_fp16": arm(graph_time([lambda w=w: F.linear(x, w) for w in w16]), n * k * 2 + m * k * 2)}
        r["fp4"] = arm(graph_time([lambda w=w: fp4_gemv(x, w) for w in copies]), nbytes + m * k * 2)
        r["fp4"].update(config=list(default_config(n, k, m, FP4_BLOCKS[fmt], 90)), rel_err=rel)
        if sweep:
            grid = {str(c): round(graph_time([lambda w=w, c=c: fp4_gemv(x, w, c) for w in copies]) * 1e6, 2)
                    for c in SWEEP[m] if fits(c, k)}
            best = min(grid, key=grid.get)
            r["fp4_sweep_us"] = grid
            r["fp4_best"] = {"config": best, **arm(grid[best] / 1e6, nbytes + m * k * 2)}
        log(f"  {fmt} {name} M={m}: " + "  ".join(f"{a} {v['us']}us {v['frac_copy_limit']:.0%}"
                                                   for a, v in r.items() if isinstance(v, dict) and "us" in v))
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=".onecat/quant_h200_fp4.json")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--shapes", default="qkv,o,gate_up,down")
    ap.add_argument("--precompile", type=int, default=0)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_fp4.py needs a CUDA GPU (none visible to torch)")
    shapes = args.shapes.split(",")
    if args.precompile:
        import concurrent.futures as cf
        import multiprocessing as mp

        with cf.ProcessPoolExecutor(args.precompile, mp_context=mp.get_context("spawn")) as ex:
            for done in ex.map(_compile_one, tasks(shapes, args.sweep)):
                log("compiled", done)
    copy_gbps = copy_limit_gbps()
    record = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "label": "measured",
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "copy_limit_GBps": round(copy_gbps, 1), "formats": {}}
    for fmt in FORMATS:
        record["formats"][fmt] = {name: bench(fmt, name, *SHAPES[name], args.sweep, copy_gbps) for name in shapes}
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
    log("wrote", args.out)


if __name__ == "__main__":
    main()
