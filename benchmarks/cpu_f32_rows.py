"""The float32 rows kernel (engine/kernels/f32_rows.py) against oneDNN's blocked GEMM on the embedded model's
projections, CPU.

Each projection's weights are drawn for 30 layers (the LM head once) and every call walks all of them, so the
weights come from memory as in a decode step; per row count the two kernels alternate (oneDNN, rows, oneDNN,
rows, ...) and each keeps its median over the repeats. A one-row call with K > 1024 goes to oneDNN as two rows,
as engine/layers/batch_invariant_linear.py sends it. Also the sum over one step's projections (30 layers plus
the head) at each row count, and the check that both give each row the bits it has alone. Prints a table and
writes a JSON record; at a 1-minute load of 1.5 or more it refuses to measure unless --allow-loaded (marked).

    python benchmarks/cpu_f32_rows.py [--rows 1,2,4,8,16,64,256] [--repeats 5] [--threads 2] [--out FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from speculative_dflash import machine_info

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}
LAYERS = 30
LOAD_LIMIT = 1.5


def timed(fn, weights, x, repeats: int) -> float:
    """Seconds a call (per weight), one pass over every weight per repeat."""
    t = time.perf_counter()
    for _ in range(repeats):
        for w in weights:
            fn(x, w)
    return (time.perf_counter() - t) / repeats / len(weights)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,2,4,8,16,64,256")
    ap.add_argument("--repeats", type=int, default=5, help="alternations of the two kernels per row count")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--allow-loaded", action="store_true")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/cpu_f32_rows.json"))
    args = ap.parse_args()
    load = os.getloadavg()[0]
    if load >= LOAD_LIMIT and not args.allow_loaded:
        raise SystemExit(f"1-minute load {load:.2f} >= {LOAD_LIMIT}: wait for a quiet machine or pass --allow-loaded")
    torch.set_num_threads(args.threads)
    from onecat.engine.kernels import f32_rows
    from onecat.engine.kernels.onednn import onednn_blocked, onednn_matmul
    from onecat.engine.layers.batch_invariant_linear import ONE_ROW_KERNEL_ABOVE_K

    reason = f32_rows.unavailable_reason()
    if reason is not None:
        raise SystemExit(f"the rows kernel does not run here: {reason}")
    rows_list = [int(r) for r in args.rows.split(",")]
    record = {"benchmark": "cpu_f32_rows", "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              **machine_info("cpu"), "loaded": load >= LOAD_LIMIT, "layers": LAYERS, "repeats": args.repeats,
              "unit": "us a call (median)", "projections": {}, "step_us": {}}
    g = torch.Generator().manual_seed(0)

    def onednn(x, w):
        one = x.shape[0] == 1 and x.shape[1] > ONE_ROW_KERNEL_ABOVE_K
        return onednn_matmul(x.expand(2, -1).contiguous() if one else x, w)

    for name, (n, k) in SHAPES.items():
        dense = [torch.randn(n, k, generator=g) * 0.02 for _ in range(1 if name == "lm_head" else LAYERS)]
        blocked, tiles = [onednn_blocked(d) for d in dense], [f32_rows.pack(d) for d in dense]
        per_rows = {}
        for m in rows_list:
            x = torch.randn(m, k, generator=g)
            same = all(torch.equal(f32_rows.matmul(x[i:i + 1], tiles[0], n), f32_rows.matmul(x, tiles[0], n)[i:i + 1])
                       for i in range(m))
            reps = max(1, min(5, 64 // m))
            timed(onednn, blocked, x, 1)
            timed(lambda xx, w: f32_rows.matmul(xx, w, n), tiles, x, 1)
            a, b = [], []
            for _ in range(args.repeats):
                a.append(timed(onednn, blocked, x, reps))
                b.append(timed(lambda xx, w: f32_rows.matmul(xx, w, n), tiles, x, reps))
            per_rows[m] = {"onednn_us": round(statistics.median(a) * 1e6, 1),
                           "rows_us": round(statistics.median(b) * 1e6, 1), "rows_alone_equal_batched": same}
            per_rows[m]["ratio"] = round(per_rows[m]["rows_us"] / per_rows[m]["onednn_us"], 3)
        record["projections"][name] = per_rows
        print(f"{name:8s} " + " | ".join(f"m={m}: {v['onednn_us']:.0f} / {v['rows_us']:.0f} us ({v['ratio']:.2f}x)"
                                        for m, v in per_rows.items()), flush=True)
    for m in rows_list:
        step = {kern: sum(record["projections"][p][m][f"{kern}_us"] * (1 if p == "lm_head" else LAYERS)
                          for p in SHAPES) for kern in ("onednn", "rows")}
        record["step_us"][m] = {**{k: round(v, 1) for k, v in step.items()},
                                "ratio": round(step["rows"] / step["onednn"], 3)}
        print(f"one step's projections, {m} rows: oneDNN {step['onednn'] / 1e3:.1f} ms, "
              f"rows {step['rows'] / 1e3:.1f} ms ({step['rows'] / step['onednn']:.2f}x)")
    record["load_average_1m_end"] = os.getloadavg()[0]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"written: {args.out}")


if __name__ == "__main__":
    main()
