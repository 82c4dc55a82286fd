"""`sample()` alone on a CPU: keyed draws (engine/core/keyed_draws.py) against a baseline tree whose sampler drew
from per-request torch.Generator streams (`sample(logits, params, generators)`, e.g. a `git worktree` of a commit
before keyed draws). Random logits (randn x 4 over the embedded model's 49,152 ids), batch 1 and 64, three
settings; the arms alternate, median of the repeats after the first.

    python benchmarks/sampler_keyed_ab_cpu.py --baseline-tree /tmp/base [--out FILE]
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import time
from pathlib import Path

import torch

from onecat.engine.core import sampler
from onecat.engine.core.keyed_draws import row_keys
from onecat.engine.sampling_params import SamplingParams
from speculative_dflash import machine_info

SETTINGS = {"top_p0.95": dict(temperature=0.8, top_p=0.95), "seed_route": dict(temperature=1.0, top_p=0.95, top_k=20),
            "temperature": dict(temperature=0.8)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline-tree", type=Path, required=True)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "sampler_keyed_ab_cpu.json")
    args = ap.parse_args()
    spec = importlib.util.spec_from_file_location("baseline_sampler", args.baseline_tree / "engine/core/sampler.py")
    baseline = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(baseline)
    torch.manual_seed(0)
    rows = []
    for batch in (1, 64):
        logits = torch.randn(batch, args.vocab) * 4
        for name, kw in SETTINGS.items():
            params = [SamplingParams(**kw, seed=i) for i in range(batch)]
            times: dict[str, list[float]] = {"generators": [], "keyed": []}
            for r in range(args.repeats):
                gens = [torch.Generator().manual_seed(i) for i in range(batch)]
                t = time.perf_counter()
                baseline.sample(logits, params, gens)
                times["generators"].append(time.perf_counter() - t)
                t = time.perf_counter()
                sampler.sample(logits, params, row_keys(range(batch), [r] * batch, "cpu"))
                times["keyed"].append(time.perf_counter() - t)
            row = {"batch": batch, "setting": name,
                   **{f"{k}_ms": statistics.median(v[1:]) * 1e3 for k, v in times.items()}}
            row["ratio"] = row["keyed_ms"] / row["generators_ms"]
            rows.append(row)
            print(f"batch {batch:3d} {name:12s} generators {row['generators_ms']:7.2f} ms  keyed {row['keyed_ms']:7.2f} ms"
                  f"  ratio {row['ratio']:.2f}", flush=True)
    record = {"benchmark": "sampler_keyed_ab_cpu", "kind": "measured", "machine": machine_info("cpu"),
              "vocab": args.vocab, "logits": "randn x 4", "repeats": args.repeats,
              "baseline": str(args.baseline_tree), "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
