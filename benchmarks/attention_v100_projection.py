"""PROJECTED (not measured) V100 speed of the FLASH_ATTN_V100 kernels from a roofline model.

The model lives in onecat.engine.kernel_tools.projection (shared with `onecat kernels bench`).

Model: time >= max(useful FLOPs / compute peak, bytes moved / peak HBM2 bandwidth), with
V100-SXM2 peaks of 900 GB/s and, as compute peak, 125 TFLOP/s FP16 HMMA for prefill (tensor
cores) but 15.7 TFLOP/s FP32 FMA for decode/verify (that kernel computes on the FP32 pipes). The projection is the
roofline *bound* (an upper bound on speed); real kernels reach a fraction of it. Useful FLOPs
count only the causal QK^T and PV work (4 * q * k * d per head, halved on the causal triangle);
decode bytes count each sequence's K/V (and FP8 scales) once per kv head plus Q and output.
Nothing here runs on a GPU, and no figure it prints is a V100 measurement.

    python benchmarks/attention_v100_projection.py
"""
from __future__ import annotations

import argparse
import json
from dataclasses import asdict

from onecat.engine.kernel_tools.projection import MODEL, default_table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print JSON records instead of a table")
    args = ap.parse_args()
    rows = default_table()
    if args.json:
        print(json.dumps([asdict(r) for r in rows], indent=2))
        return
    print(f"PROJECTED V100 figures ({MODEL}); not measurements")
    print(f"{'kernel':<16}{'shape':<46}{'bound':<9}{'ms':>10}{'TFLOP/s':>10}")
    for r in rows:
        print(f"{r.kernel:<16}{r.shape:<46}{r.bound:<9}{r.projected_ms:>10.3f}{r.projected_tflops:>10.1f}")


if __name__ == "__main__":
    main()
