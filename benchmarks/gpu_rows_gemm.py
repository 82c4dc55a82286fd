"""Few-row GEMM on a CUDA GPU: onecat's Triton kernel (engine/kernels/triton_rows_gemm.py) and its tensor-core
rows GEMV (engine/kernels/dense_rows.py, up to 16 rows) against cuBLAS for the 8B projections at the row counts
of a verify step, a drafter's block and a small batch.

    python benchmarks/gpu_rows_gemm.py --out results.json [--rows 2,4,8,16,32] [--sweep] [--dtype bfloat16]

Timed as benchmarks/gpu_gemv.py times (a CUDA graph over rotating weight copies that L2 cannot hold), so a
figure is what a step pays: DRAM streaming plus each kernel's launch and tail. Per shape and row count:
  gemv_1row          the batch-1 GEMV on one row (what a plain batch-1 step pays for this projection)
  cublas             F.linear
  rows_gemm          the few-row GEMM, default tile config
  dense_gemv         the tensor-core rows GEMV (1-16 rows; with its weight-read rate, dense_gemv_GBps)
and for the projections the engine fuses with their neighbours (the norm before, SiLU*mul after gate/up):
  separate[...]      add_rmsnorm kernel + cuBLAS (+ silu_mul kernel): the step before this kernel
  rows_gemm[...]     add_rmsnorm kernel + the few-row GEMM (with SiLU*mul folded in)
  dense_gemv[...]    add_rmsnorm kernel + the rows GEMV (with SiLU*mul folded in)
With --sweep, the kernel (with SiLU*mul on gate/up) over a grid of tile configs and both operand orders at 8
and 16 rows; the best is reported. Every Triton arm is checked against an fp32 reference first (relative max
error < 1e-2).
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform

import torch
import torch.nn.functional as F
from gpu_gemv import L2_FLUSH_BYTES, SHAPES, graph_time, log, rel_err

DEFAULT_SHAPES = "llama3-8b.qkv,llama3-8b.o,llama3-8b.gate_up,llama3-8b.down,llama3-8b.lm_head"
# also a DFlash drafter layer of route 1's Qwen3.5-27B target (its width, bf16): gate/up and down
ROWS_SHAPES = {**SHAPES, "qwen3.5-27b.gate_up": (34816, 5120, "norm+glu"), "qwen3.5-27b.down": (5120, 17408, None)}


def sweep_configs() -> list[tuple[int, int, int, int, bool]]:
    """(BLOCK_N, BLOCK_K, STAGES, num_warps, SWAP)."""
    plain = [(bn, bk, st, 4, False) for bn in (16, 32, 64) for bk in (128, 256) for st in (4, 5, 6)]
    swapped = [(bn, bk, st, w, True) for bn in (32, 64, 128) for bk in (64, 128, 256) for st in (3, 4, 5)
               for w in (4, 8) if bn * bk <= 16384 and (w == 4 or bn >= 64)]
    return plain + swapped


def bench(name: str, rows: list[int], sweep: bool, dt: torch.dtype = torch.float16) -> dict:
    import triton

    from onecat.engine.kernels import dense_rows as dr
    from onecat.engine.kernels import triton_fused as tf
    from onecat.engine.kernels import triton_gemv as tg
    from onecat.engine.kernels import triton_rows_gemm as rg

    n, k, fused = ROWS_SHAPES[name]
    glu = fused == "norm+glu"
    copies = max(3, -(-L2_FLUSH_BYTES // (n * k * 2)))
    gen = torch.Generator(device="cuda").manual_seed(0)
    ws = [torch.randn(n, k, device="cuda", dtype=dt, generator=gen) * k ** -0.5 for _ in range(copies)]
    r_all = torch.randn(max(rows), k, device="cuda", dtype=dt, generator=gen)
    nw = torch.rand(k, device="cuda", dtype=dt, generator=gen) + 0.5
    x1 = torch.randn(1, k, device="cuda", dtype=dt, generator=gen)
    us = lambda calls: round(graph_time(calls) * 1e6, 2)  # noqa: E731
    out = {"N": n, "K": k, "weight_MB": n * k * 2 / 1e6, "fused": fused,
           "gemv_1row_us": us([lambda w=w: tg.gemv(x1, w) for w in ws])}
    if fused:  # the batch-1 GEMV folds the norm (and SiLU*mul) in
        out[f"gemv_1row[{fused}]_us"] = us([lambda w=w: tg.gemv(x1, w, residual=r_all[:1], norm_weight=nw, eps=1e-5,
                                                                glu=glu) for w in ws])
    for m in rows:
        x = torch.randn(m, k, device="cuda", dtype=dt, generator=gen)
        r = r_all[:m]
        ref = x.float() @ ws[0].float().T
        err = rel_err(rg.rows_gemm(x, ws[0]), ref)
        assert err < 1e-2, f"{name} {m} rows: error {err}"
        res = out[str(m)] = {"config": list(rg.default_config(m, n, k, False)), "rel_err": err,
                             "cublas_us": us([lambda w=w: F.linear(x, w) for w in ws]),
                             "rows_gemm_us": us([lambda w=w: rg.rows_gemm(x, w) for w in ws])}
        dense = m <= 16
        if dense:
            res["dense_gemv_rel_err"] = derr = rel_err(dr.dense_rows_gemv(x, ws[0]), ref)
            assert derr < 1e-2, f"{name} {m} rows, rows GEMV: error {derr}"
            res["dense_gemv_us"] = us([lambda w=w: dr.dense_rows_gemv(x, w) for w in ws])
            res["dense_gemv_GBps"] = round(n * k * 2 / res["dense_gemv_us"] / 1e3, 1)
        if glu:
            gref = F.silu(ref[:, :n // 2]) * ref[:, n // 2:]
            res["rows_gemm[glu]_rel_err"] = gerr = rel_err(rg.rows_gemm(x, ws[0], glu=True), gref)
            assert gerr < 1e-2, f"{name} {m} rows glu: error {gerr}"
            if dense:
                res["dense_gemv[glu]_rel_err"] = gerr = rel_err(dr.dense_rows_gemv(x, ws[0], glu=True), gref)
                assert gerr < 1e-2, f"{name} {m} rows, rows GEMV glu: error {gerr}"
        if fused:
            def separate(w):
                y = F.linear(tf.add_rmsnorm(x, r, nw, 1e-5)[0], w)
                return tf.silu_mul(y) if glu else y

            res[f"separate[{fused}]_us"] = us([lambda w=w: separate(w) for w in ws])
            res[f"rows_gemm[{fused}]_us"] = us([lambda w=w: rg.rows_gemm(tf.add_rmsnorm(x, r, nw, 1e-5)[0], w, glu=glu)
                                                for w in ws])
            if dense:
                normed = lambda: tf.add_rmsnorm(x, r, nw, 1e-5)[0]  # noqa: E731
                res[f"dense_gemv[{fused}]_us"] = us([lambda w=w: dr.dense_rows_gemv(normed(), w, glu=glu) for w in ws])
        if sweep and m in (8, 16):
            grid = {}
            for bn, bk, st, wp, swap in sweep_configs():
                cfg = (16, bn, bk, st, wp, swap)
                try:
                    y = rg.rows_gemm(x, ws[0], glu=glu, config=cfg)
                except triton.runtime.errors.OutOfResources:  # stages x tile over the SM's shared memory
                    grid[str(cfg)] = "out of shared memory"
                    continue
                if rel_err(y, gref if glu else ref) >= 1e-2:
                    grid[str(cfg)] = "error"
                    continue
                grid[str(cfg)] = us([lambda w=w, c=cfg: rg.rows_gemm(x, w, glu=glu, config=c) for w in ws])
            timed = {c: t for c, t in grid.items() if not isinstance(t, str)}
            best = min(timed, key=timed.get)
            res["sweep_us"], res["sweep_best"] = grid, {"config": best, "us": timed[best]}
        log(f"  {name} {m} rows:", {a: v for a, v in res.items() if a.endswith("_us") or a == "sweep_best"})
    del ws
    torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=".onecat/gpu_rows_gemm.json")
    ap.add_argument("--shapes", default=DEFAULT_SHAPES)
    ap.add_argument("--rows", default="2,4,8,16,32")
    ap.add_argument("--sweep", action="store_true", help="also time a grid of tile configs at 8 and 16 rows")
    ap.add_argument("--dtype", choices=("float16", "bfloat16"), default="float16",
                    help="weights and activations (a DFlash drafter of a bf16 target runs bfloat16)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_rows_gemm.py needs a CUDA GPU (none visible to torch)")
    import triton

    record = {"machine": {"gpu": torch.cuda.get_device_name(), "host": platform.node(), "torch": torch.__version__,
                          "cuda": torch.version.cuda, "triton": triton.__version__},
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "note": f"random {args.dtype} weights; CUDA-graph timing over rotating weight copies", "shapes": {}}
    for name in args.shapes.split(","):
        log(name)
        record["shapes"][name] = bench(name, [int(m) for m in args.rows.split(",")], args.sweep, getattr(torch, args.dtype))
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
    log("wrote", args.out)


if __name__ == "__main__":
    main()
