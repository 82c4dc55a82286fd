"""Packed projections at a verify step's or a larger decode batch's row counts (17-128) on a CUDA GPU: the packed
many-row GEMM (engine/kernels/triton_packed_rows.py) against the path it replaces (the words un-tiled, the weight
dequantized into bf16, cuBLAS) and against the packed GEMV in 8-row launches and in 16-row launches of the
tensor-core GEMV (two B operands, ONECAT_GEMV_16_ROWS), for the Qwen3.5-27B projections (route 1's target), NVFP4,
W4A16 (groups of 128) or FP8.

    python benchmarks/gpu_packed_rows.py --out results.json [--format nvfp4|w4a16|fp8] [--rows 17,32,64,128]
        [--arms dense,packed_rows,gemv_blocks_8,gemv_blocks_16] [--sweep]

At 16 rows or fewer, give --arms gemv_blocks_8,gemv_blocks_16: the layers' own arms take the GEMV there.

Each layer keeps its words as the engine keeps them (FP4Linear.use_tiles: the tensor-core GEMV's tiles, codes in
bf16's slots). Timed as benchmarks/gpu_gemv.py times (a CUDA graph over weight copies that L2 cannot hold). Every
arm is checked against the dequantized weight's fp32 product first (relative max error < 2e-2). With --sweep,
the many-row GEMM also over a grid of (BLOCK_N, num_warps, K split) at 32 and 128 rows; the best is reported next
to the default config's time.
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform

import torch
import torch.nn.functional as F
from gpu_gemv import L2_FLUSH_BYTES, graph_time, log, rel_err

SHAPES = {  # name: (N, K), Qwen3.5-27B (engine/random_models.py)
    "qwen3.5-27b.gate_up": (34816, 5120), "qwen3.5-27b.down": (5120, 17408),
    "qwen3.5-27b.gdn_in": (16480, 5120), "qwen3.5-27b.attn_qkv": (14336, 5120), "qwen3.5-27b.o": (5120, 6144)}


def layers(n: int, k: int, dt: torch.dtype, fmt: str) -> list:
    from onecat.engine.quant.fp4.linear import FP4Linear
    from onecat.engine.quant.fp8.linear import FP8Linear
    from onecat.engine.quant.rtn import quantize
    from onecat.engine.quant.w4a16.linear import W4A16Linear

    copies = max(2, -(-L2_FLUSH_BYTES // (n * k // 2)))
    out = []
    for i in range(copies):
        gen = torch.Generator(device="cuda").manual_seed(i)
        weight = quantize(torch.randn(n, k, device="cuda", generator=gen) * k ** -0.5, fmt, group=128)
        layer = {"w4a16": W4A16Linear, "fp8": FP8Linear}.get(fmt, FP4Linear)(weight)
        layer.use_tiles(dt)
        out.append(layer)
    return out


def dense_weight(layer, dt: torch.dtype) -> torch.Tensor:
    from onecat.engine.quant.fp4.layout import dequantize as fp4_dequantize
    from onecat.engine.quant.fp8.layout import dequantize as fp8_dequantize
    from onecat.engine.quant.w4a16.layout import dequantize as w4_dequantize

    dequantize = {"int4": w4_dequantize, "fp8": fp8_dequantize}.get(layer.words_format, fp4_dequantize)
    return dequantize(layer.packed()).to(dt)


def blocked_gemv(layer, x: torch.Tensor, block: int = 8) -> torch.Tensor:
    from onecat.engine.kernels import quant_gemv

    fmt, scales, row_scale, group = layer.gemv_operands()
    return torch.cat([quant_gemv.packed_gemv(x[i:i + block], fmt, layer.qweight, scales, row_scale, group,
                                             tiled=layer.tiled) for i in range(0, x.shape[0], block)])


ARMS = {"dense": lambda layer, x: layer(x), "packed_rows": lambda layer, x: layer(x),
        "gemv_blocks_8": blocked_gemv, "gemv_blocks_16": lambda layer, x: blocked_gemv(layer, x, 16)}


SWEEP = [(bn, w, 2, sp) for bn in (64, 128) for w in (4, 8) for sp in (1, 2, 4)]  # (BLOCK_N, warps, stages, SPLIT)
SWEEP_ROWS = (32, 128)


def sweep(ls, x: torch.Tensor, ref: torch.Tensor) -> dict:
    """The many-row GEMM's time at each SWEEP config (wrong results and configs that do not compile are skipped)."""
    from onecat.engine.kernels.quant_gemv import SLOT_DTYPES
    from onecat.engine.kernels.triton_packed_rows import config, fp4_rows_gemm, fp8_rows_gemm, w4a16_rows_gemm
    from onecat.engine.quant.fp4.linear import FMT_IDS

    block_m = config(x.shape[0], ls[0].out_features, ls[0].in_features)[1]
    times = {}
    for bn, warps, stages, split in SWEEP:
        cfg = (bn, block_m, warps, stages, split)
        if ls[0].words_format == "int4":
            call = lambda layer, cfg=cfg: w4a16_rows_gemm(  # noqa: E731
                x, layer.qweight, layer.scales, layer.zeros, layer.group, layer.tiled, cfg=cfg)
        elif ls[0].words_format == "fp8":
            call = lambda layer, cfg=cfg: fp8_rows_gemm(  # noqa: E731
                x, layer.qweight, layer.scale, layer.tiled, cfg=cfg)
        else:
            call = lambda layer, cfg=cfg: fp4_rows_gemm(  # noqa: E731
                x, layer.qweight, layer.scales, layer.gscale, FMT_IDS[layer.fmt], tiled=layer.tiled,
                slots=SLOT_DTYPES.get(layer.tiled), cfg=cfg)
        try:
            if rel_err(call(ls[0]), ref) > 2e-2:
                continue
            seconds = graph_time([lambda ly=ly: call(ly) for ly in ls])
            times[f"{bn}x{block_m}/w{warps}/s{stages}/k{split}"] = round(seconds * 1e6, 2)
        except Exception as exc:  # out of shared memory or registers at this tile: not a candidate
            log(f"config {cfg} skipped: {str(exc).splitlines()[0][:120]}")
    best = min(times, key=times.get) if times else None
    return {"configs_us": times, "best": best, "best_us": times.get(best)}


def bench(name: str, rows: list[int], fmt: str, arm_names: list[str], do_sweep: bool = False) -> dict:
    from onecat.engine.kernels import quant_gemv, triton_packed_rows, triton_support

    n, k = SHAPES[name]
    dt = torch.float16 if fmt == "w4a16" else torch.bfloat16  # W4A16's tensor-core GEMV (its tiles) takes fp16
    ls = layers(n, k, dt, fmt)
    out = {"N": n, "K": k, "dtype": str(dt), "packed_MB": n * k * 0.5625 / 1e6, "tiled": ls[0].tiled,
           "copies": len(ls), "rows": {}}
    us = lambda calls: round(graph_time(calls) * 1e6, 2)  # noqa: E731
    for m in rows:
        x = torch.randn(m, k, device="cuda", dtype=dt)
        ref = F.linear(x.float(), dense_weight(ls[0], dt).float())
        arms = {}
        gemv_rows = dict(quant_gemv.BLOCKED_ROWS_BY_FORMAT)  # the layers' own arms: the GEMV held to 16 rows
        quant_gemv.BLOCKED_ROWS_BY_FORMAT.update({per_call: dict.fromkeys(t, 16) for per_call, t in gemv_rows.items()})
        for arm in arm_names:
            triton_support.PACKED_ROWS_GEMM = arm == "packed_rows"
            call = ARMS[arm]
            err = rel_err(call(ls[0], x), ref)
            if err > 2e-2:
                raise SystemExit(f"{name} {arm} at {m} rows: relative error {err:.3g} against the dense product")
            arms[arm] = {"us": us([lambda layer=layer: call(layer, x) for layer in ls]), "rel_err": round(err, 5)}
        triton_support.PACKED_ROWS_GEMM = False
        quant_gemv.BLOCKED_ROWS_BY_FORMAT.update(gemv_rows)
        if "packed_rows" in arms:  # BLOCK_N, BLOCK_M, warps, stages, split
            packed_fmt = getattr(triton_packed_rows, fmt.upper())  # NVFP4, MXFP4, W4A16, FP8
            arms["packed_rows"]["config"] = list(triton_packed_rows.config(m, n, k, packed_fmt))
        if do_sweep and m in SWEEP_ROWS:
            arms["sweep"] = sweep(ls, x, ref)
            log(f"{name} rows {m}: best config {arms['sweep']['best']} {arms['sweep']['best_us']} us")
        if "dense" in arms and "packed_rows" in arms:
            arms["packed_rows_vs_dense"] = round(arms["dense"]["us"] / arms["packed_rows"]["us"], 3)
        out["rows"][m] = arms
        log(f"{name} rows {m}: " + ", ".join(f"{arm} {arms[arm]['us']} us" for arm in arm_names))
    del ls
    torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="17,32,64,128")
    ap.add_argument("--format", choices=("nvfp4", "w4a16", "fp8"), default="nvfp4")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--arms", default=",".join(ARMS), help=f"which of {', '.join(ARMS)}")
    ap.add_argument("--sweep", action="store_true", help="also time the many-row GEMM over SWEEP's tile configs")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    arm_names = args.arms.split(",")
    if not set(arm_names) <= set(ARMS):
        raise SystemExit(f"--arms {args.arms}: expected some of {', '.join(ARMS)}")
    result = {"benchmark": "gpu_packed_rows", "kind": "measured", "measured_on": torch.cuda.get_device_name(0),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(), "host": platform.node(),
              "format": args.format, "shapes": {}}
    for name in args.shapes.split(","):  # written after each shape: a run cut short keeps what it measured
        result["shapes"][name] = bench(name, rows, args.format, arm_names, args.sweep)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
