"""The CUDA packed-weight GEMV (csrc/quant_gemv) against cuBLAS on fp16 weights and the Triton GEMVs, on the
Llama-3-8B projections (qkv, o, gate_up, down) at 1 and 8 rows (--rows): W4A16 (group 128), NVFP4, MXFP4, FP8.

    python benchmarks/gpu_quant_gemv.py --out benchmarks/results/quant_gemv_h200.json [--rows 1,8] [--sweep]

Timing as in gpu_w4a16.py: each arm is called once per rotating copy of its weight (enough copies that the
L2 cache holds none between calls) inside one CUDA graph, median of 20 replays, per call. Bytes are what a
call must read: codes + scales (+ zeros) + x; fp16 weights 2 B each. The copy limit is a large
device-to-device copy timed in the same run. "layer" sums the four projections (bytes over time), as a
decode step sees them. --sweep also times the CUDA GEMV at fixed splits of K (1, 2, 4, 8) beside its default.
Where the tensor-core GEMV takes the call on SM80+ (W4A16 fp16 g128, NVFP4, FP8, MXFP4 with bf16 activations:
"cuda_int4", "cuda_nvfp4", "cuda_fp8" and their "_bf16", "cuda_mxfp4_bf16"), "cuda_fma_*" is the FMA GEMV on
the same weights; NVFP4, MXFP4 and FP8 are timed with fp16 and with bf16 activations (*_bf16). "*_tiled" is
the tensor-core GEMV on the same weights in its tiles (quant_gemv.mma_tiles), "cuda_*fp4*_slots" FP4 in tiles
with its codes in the activation dtype's slots (engine/quant/fp4/slots.py): what packed layers hold. For gate_up,
"*_glu" is that GEMV writing SiLU(gate) * up, "*_then_silu_mul" the GEMV then the separate SiLU * mul kernel (what
a packed MLP ran before). --formats picks a subset of the formats.
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import traceback

import torch
import torch.nn.functional as F
from gpu_gemv import graph_time, log
from gpu_w4a16 import L2_FLUSH_BYTES, SHAPES, copy_limit_gbps

LAYER = ("qkv", "o", "gate_up", "down")
FORMATS = ("int4", "nvfp4", "mxfp4", "fp8")
BF16_TOO = ("nvfp4", "mxfp4", "fp8")  # also timed with bf16 activations (*_bf16): MXFP4 takes the tensor cores only then


def random_weight(fmt: str, n: int, k: int, gen) -> dict:
    """Kernel arguments of a random packed weight, its byte count and the Triton arm's call (None for FP8)."""
    from onecat.engine.quant.w4a16.layout import scale_zero_pairs

    if fmt == "int4":
        q = torch.randint(-2**31, 2**31 - 1, (n, k // 8), dtype=torch.int32, device="cuda", generator=gen)
        s = (torch.rand(n, k // 128, device="cuda", generator=gen) * 0.02 + 0.001).half()
        z = torch.randint(0, 16, (n, k // 128), device="cuda", generator=gen).half()
        sz = scale_zero_pairs(s, z)
        return dict(qweight=q, scales=sz, group=128, nbytes=q.numel() * 4 + sz.numel() * 2)
    if fmt == "fp8":
        q = torch.randint(-2**31, 2**31 - 1, (n, k // 4), dtype=torch.int32, device="cuda", generator=gen)
        q &= 0x7E7E7E7E  # no NaN bytes, positive
        s = torch.rand(n, device="cuda", generator=gen) * 1e-3
        return dict(qweight=q, scales=s, row_scale=s, nbytes=q.numel() * 4 + n * 4)
    from gpu_fp4 import random_fp4

    w = random_fp4(fmt, n, k, gen)
    extra = 0 if w.gscale is None else n * 4
    return dict(qweight=w.qweight, scales=w.scales, row_scale=w.gscale, fp4=w,
                nbytes=w.qweight.numel() * 4 + w.scales.numel() + extra)


def cuda_call(x, a: dict, fmt: str, splits: int = 0, kernel: str = "auto", tiled: int = 0, glu: bool = False):
    """packed_gemv on a's words in the layout `tiled` (a["tiles1"], a["tiles2"]: mma_tiled's, kept here)."""
    from onecat.engine.kernels.quant_gemv import packed_gemv

    w = a[f"tiles{tiled}"] if tiled else a["qweight"]
    return lambda: packed_gemv(x, fmt, w, a["scales"], a.get("row_scale"), a.get("group", 0), splits,
                               kernel=kernel, tiled=tiled, glu=glu)


def mma_tiled(a: dict, fmt: str, layout: int) -> torch.Tensor:
    """a's words in the tensor-core GEMV's tiles, NVFP4's codes also in slots for the slot layouts."""
    from onecat.engine.kernels.quant_gemv import SLOT_DTYPES, mma_tiles
    from onecat.engine.quant.fp4.slots import to_slots

    slots = SLOT_DTYPES.get(layout)
    return mma_tiles(a["qweight"] if slots is None else to_slots(a["qweight"], slots, fmt), fmt)


def triton_call(x, a: dict, fmt: str):
    if fmt == "int4":
        from onecat.engine.kernels.triton_w4a16 import w4a16_gemv

        return lambda: w4a16_gemv(x, a["qweight"], a["scales"], 128)
    if fmt in ("nvfp4", "mxfp4"):
        from onecat.engine.quant.fp4.linear import fp4_gemv

        return lambda: fp4_gemv(x, a["fp4"])
    return None


def bench_shape(name: str, n: int, k: int, rows: list[int], sweep: bool, copy_gbps: float,
                formats: list[str] = list(FORMATS)) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(0)
    fp16_bytes = n * k * 2
    c16 = max(3, -(-L2_FLUSH_BYTES // fp16_bytes))
    ws = [torch.randn(n, k, device="cuda", dtype=torch.float16, generator=gen) * k ** -0.5 for _ in range(c16)]
    packs = {}
    for fmt in formats:
        first = random_weight(fmt, n, k, gen)
        copies = max(3, -(-L2_FLUSH_BYTES // first["nbytes"]))
        packs[fmt] = [first] + [random_weight(fmt, n, k, gen) for _ in range(copies - 1)]
    res = {"N": n, "K": k, "bytes": {"fp16": fp16_bytes, **{f: p[0]["nbytes"] for f, p in packs.items()}}}

    def arm(t: float, moved: int, **extra) -> dict:
        gbps = moved / t / 1e9
        return {"us": round(t * 1e6, 2), "GBps": round(gbps, 1), "frac_copy_limit": round(gbps / copy_gbps, 3),
                **extra}

    for m in rows:
        x = torch.randn(m, k, device="cuda", dtype=torch.float16, generator=gen)
        xb = m * k * 2
        r = res[f"M{m}"] = {"cublas_fp16": arm(graph_time([lambda w=w: F.linear(x, w) for w in ws]), fp16_bytes + xb)}
        runs = [(fmt, ps, x, "") for fmt, ps in packs.items()]
        runs += [(fmt, packs[fmt], x.bfloat16(), "_bf16") for fmt in BF16_TOO if fmt in packs]
        for fmt, ps, xx, tag in runs:
            try:
                bench_format(r, name, m, xx, fmt, ps, ps[0]["nbytes"] + xb, k, sweep, arm, tag)
            except Exception as exc:  # one format's failure is recorded, the others still run
                traceback.print_exc()
                r[f"cuda_{fmt}{tag}_error"] = f"{type(exc).__name__}: {exc}"[:300]
        log(f"  {name} M={m}: " + "  ".join(f"{a} {v['us']}us {v['frac_copy_limit']:.0%}"
                                            for a, v in r.items() if isinstance(v, dict) and "us" in v))
    del ws, packs
    torch.cuda.empty_cache()
    return res


def bench_format(r: dict, name: str, m: int, x, fmt: str, ps: list, moved: int, k: int, sweep: bool, arm,
                 tag: str = "") -> None:
    """The CUDA GEMV (and the Triton one where it exists) on one format's rotating weights, into r (keys end in
    tag: "_bf16" for bf16 activations)."""
    y = cuda_call(x, ps[0], fmt)()
    tc = triton_call(x, ps[0], fmt)
    if tc is not None:  # the two kernels agree (each is tested against float64 in tests/)
        yt = tc()
        rel = float((y.float() - yt.float()).abs().max() / yt.float().abs().max().clamp_min(1e-30))
        assert rel < 2e-2, f"{name} M={m} {fmt}: CUDA vs Triton GEMV relative difference {rel}"
    r[f"cuda_{fmt}{tag}"] = arm(graph_time([cuda_call(x, p, fmt) for p in ps]), moved)
    from onecat.engine.kernels.quant_gemv import tensor_cores_apply

    if tensor_cores_apply(x, fmt, ps[0]["scales"], ps[0].get("group", 0), False):  # cuda_int4 ran them: FMA too
        yf = cuda_call(x, ps[0], fmt, kernel="fma")()
        rel = float((y.float() - yf.float()).abs().max() / yf.float().abs().max().clamp_min(1e-30))
        assert rel < 2e-2, f"{name} M={m} {fmt}: tensor-core vs FMA GEMV relative difference {rel}"
        r[f"cuda_fma_{fmt}{tag}"] = arm(graph_time([cuda_call(x, p, fmt, kernel="fma") for p in ps]), moved)
        from onecat.engine.kernels.quant_gemv import TILED, mma_layout

        # the same weights in the tensor-core GEMV's tiles (the same bits, read in 512-byte runs), NVFP4 also with
        # its codes in the activation dtype's slots (what packed layers hold)
        for layout, suffix in ((TILED, "_tiled"), (mma_layout(fmt, x.dtype, ps[0]["scales"]), "_slots")):
            if suffix == "_slots" and layout == TILED:
                continue
            for p in ps:
                p.setdefault(f"tiles{layout}", mma_tiled(p, fmt, layout))
            assert torch.equal(cuda_call(x, ps[0], fmt, tiled=layout)(), y), f"{name} M={m} {fmt}{suffix}: bits differ"
            r[f"cuda_{fmt}{tag}{suffix}"] = arm(graph_time([cuda_call(x, p, fmt, tiled=layout) for p in ps]), moved)
        if name == "gate_up":  # what a packed MLP runs: SiLU * mul in the GEMV, or the GEMV then the separate kernel
            from onecat.engine.kernels.triton_fused import silu_mul

            layout = mma_layout(fmt, x.dtype, ps[0]["scales"])  # the words packed layers hold
            suffix = "_tiled" if layout == TILED else "_slots"
            apart = [lambda p=p: silu_mul(cuda_call(x, p, fmt, tiled=layout)()) for p in ps]
            glu = [cuda_call(x, p, fmt, tiled=layout, glu=True) for p in ps]
            assert torch.equal(glu[0](), apart[0]()), f"{name} M={m} {fmt}: SiLU * mul in the GEMV differs"
            r[f"cuda_{fmt}{tag}{suffix}_then_silu_mul"] = arm(graph_time(apart), moved)
            r[f"cuda_{fmt}{tag}{suffix}_glu"] = arm(graph_time(glu), moved)
    if tc is not None:
        r[f"triton_{fmt}{tag}"] = arm(graph_time([triton_call(x, p, fmt) for p in ps]), moved)
    if sweep:
        chunks = k // (16 if fmt == "fp8" else 32)
        grid = {}
        for s in (1, 2, 4, 8):
            if chunks % s == 0:
                try:
                    grid[s] = round(graph_time([cuda_call(x, p, fmt, s) for p in ps]) * 1e6, 2)
                except RuntimeError as exc:  # a split whose staged activations do not fit
                    grid[s] = str(exc).splitlines()[0][:80]
        r[f"cuda_{fmt}{tag}_splits_us"] = grid


def layer_sum(shapes: dict, rows: list[int], copy_gbps: float) -> dict:
    """One decoder layer's four projections per arm: summed bytes over summed per-call time."""
    out = {}
    for m in rows:
        arms = {}
        for a in shapes["qkv"][f"M{m}"]:
            if not all(isinstance(shapes[s][f"M{m}"].get(a), dict) and "us" in shapes[s][f"M{m}"][a] for s in LAYER):
                continue
            t = sum(shapes[s][f"M{m}"][a]["us"] for s in LAYER) / 1e6
            b = sum(shapes[s][f"M{m}"][a]["GBps"] * shapes[s][f"M{m}"][a]["us"] / 1e6 for s in LAYER) * 1e9
            arms[a] = {"us": round(t * 1e6, 2), "GBps": round(b / t / 1e9, 1),
                       "frac_copy_limit": round(b / t / 1e9 / copy_gbps, 3),
                       "speedup_vs_cublas_fp16": None}
        base = arms["cublas_fp16"]["us"]
        for v in arms.values():
            v["speedup_vs_cublas_fp16"] = round(base / v["us"], 2)
        out[f"M{m}"] = arms
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", default="1,8")
    ap.add_argument("--shapes", default=",".join(LAYER))
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--formats", default=",".join(FORMATS), help="a subset of " + ",".join(FORMATS))
    args = ap.parse_args()
    from onecat.engine.kernels.quant_gemv import backend

    rows = [int(r) for r in args.rows.split(",")]
    kind, why = backend()
    if kind == "triton":
        raise SystemExit(f"the CUDA packed GEMV is not available: {why}")
    copy_gbps = copy_limit_gbps()
    log(f"copy limit {copy_gbps:.0f} GB/s")
    shapes = {}
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        shapes[name] = bench_shape(name, n, k, rows, args.sweep, copy_gbps, args.formats.split(","))
    rec = {"machine": {"gpu": torch.cuda.get_device_name(), "host": platform.node(), "torch": torch.__version__,
                       "cuda": torch.version.cuda,
                       "triton": __import__("triton").__version__},
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "label": "measured",
           "note": "random packed weights (W4A16 group 128, NVFP4, MXFP4, FP8 E4M3 per-row scale) and random fp16 "
                   "weights for cuBLAS; CUDA-graph timing over rotating weight copies, median of 20 replays",
           "copy_limit_GBps": round(copy_gbps, 1), "shapes": shapes}
    if all(s in shapes for s in LAYER):
        rec["layer"] = layer_sum(shapes, rows, copy_gbps)
        for m, arms in rec["layer"].items():
            log(f"layer {m}: " + "  ".join(f"{a} {v['us']}us {v['frac_copy_limit']:.0%} x{v['speedup_vs_cublas_fp16']}"
                                           for a, v in arms.items()))
    with open(args.out, "w") as f:
        json.dump(rec, f, indent=1)
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
