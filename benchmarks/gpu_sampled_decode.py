"""Sampled against greedy decoding on a GPU, one engine, interleaved arms: target-only decode tok/s at batch 1
and 8 for greedy requests, and for requests sampled at the seed route's settings (T 1.0, top-p 0.95, top-k 20,
a seed per request) with their draws eager or replayed from a captured graph (engine/core/sampler_graphs.py), and
sampled with top-p alone (T 0.8, top-p 0.95: the whole vocabulary sorted on the GPU, no read-back) from graphs.
Random fp16 weights (`random:NAME`, load_format dummy), CUDA graphs full, one-step-ahead decode on (the default).
The sampled arms must give the same tokens (keyed draws), which the record checks.

    python benchmarks/gpu_sampled_decode.py [--shape smollm2-135m] [--out FILE]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path

from onecat.engine import LLM, SamplingParams
from onecat.engine.core import decode_pipeline

ARMS = {"greedy": dict(temperature=0.0), "sampled_eager": dict(temperature=1.0, top_p=0.95, top_k=20),
        "sampled_graphs": dict(temperature=1.0, top_p=0.95, top_k=20),
        "top_p_graphs": dict(temperature=0.8, top_p=0.95)}


def run(llm: LLM, prompts: list[list[int]], arm: str, max_tokens: int) -> tuple[float, list[list[int]]]:
    decode_pipeline.SAMPLER_GRAPHS = arm.endswith("_graphs")
    params = [SamplingParams(**ARMS[arm], max_tokens=max_tokens, ignore_eos=True,
                             **({} if arm == "greedy" else {"seed": i})) for i in range(len(prompts))]
    t = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - t
    return sum(len(o.token_ids) for o in outs) / wall, [o.token_ids for o in outs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="smollm2-135m")
    ap.add_argument("--device", default="cuda", help="cuda, or cpu for a logic check (no graphs: not a figure)")
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/gpu_sampled_decode.json"))
    args = ap.parse_args()
    import torch

    cuda = args.device.startswith("cuda")
    llm = LLM(f"random:{args.shape}", device=args.device, dtype="float16" if cuda else "float32", load_format="dummy",
              cuda_graph="full" if cuda else "off", max_model_len=64 + args.max_tokens + 16, max_num_seqs=8,
              enable_prefix_caching=False, kv_cache_memory_gb=2.0)
    vocab = llm.model_config.vocab_size
    rows = []
    for batch in [int(b) for b in args.batch_sizes.split(",")]:
        prompts = [[(7 * i + 13 * j) % (vocab - 1) + 1 for j in range(64)] for i in range(batch)]
        for arm in ARMS:  # warm-up: graph captures, the sampling graph's second sighting
            run(llm, prompts, arm, 16)
        rates: dict[str, list[float]] = {arm: [] for arm in ARMS}
        tokens: dict[str, list] = {}
        for _ in range(args.repeats):
            for arm in ARMS:
                tps, toks = run(llm, prompts, arm, args.max_tokens)
                rates[arm].append(tps)
                tokens.setdefault(arm, toks)
        row = {"batch_size": batch, **{f"{arm}_tok_s": statistics.median(r) for arm, r in rates.items()},
               "per_repeat": rates,
               "sampled_tokens_identical": tokens["sampled_eager"] == tokens["sampled_graphs"]}
        rows.append(row)
        print(f"batch {batch}: " + ", ".join(f"{arm} {row[f'{arm}_tok_s']:.1f} tok/s" for arm in ARMS)
              + f"; sampled tokens identical: {row['sampled_tokens_identical']}", flush=True)
    record = {"benchmark": "gpu_sampled_decode", "kind": "measured" if cuda else "logic check (cpu, not a figure)",
              "measured_on": torch.cuda.get_device_name() if cuda else "cpu",
              "date": datetime.now(timezone.utc).isoformat(), "shape": args.shape, "weights": "random fp16",
              "max_tokens": args.max_tokens, "repeats": args.repeats, "arms": ARMS, "rows": rows,
              "sampling_graphs": llm.info()["async_scheduling"]["sampling_graphs"]}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    llm.close()


if __name__ == "__main__":
    main()
