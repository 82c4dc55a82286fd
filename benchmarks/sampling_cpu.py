"""The sampler's cost on the embedded model (CPU): each sampled step's `sample()` alone, and end-to-end sampled
decoding, against a baseline sampler module in the same run (interleaved, median of the repeats).

The baseline is another tree's engine/core/sampler.py (`--baseline-tree`, e.g. a `git worktree` of an earlier
commit whose `sample(logits, params, keys)` takes (seed, position) keys, as the engine hands them since keyed
draws: an older sampler took per-request generators and cannot be swapped in), loaded as a module of its own
and swapped into the engine for its arm; both arms decode the same
prompts with the same seeds. Logits for the `sample()` timing are the model's own (prompts' last positions),
so the distributions have the model's shape, not a random one's. Settings: top_p 0.95 (T 0.8), the seed route's
T 1.0 / top_p 0.95 / top_k 20, and temperature alone.

    python benchmarks/sampling_cpu.py --baseline-tree /tmp/base [--batch-sizes 16,64,256] [--repeats 3]
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import time
from pathlib import Path

import torch

from onecat.engine import LLM, SamplingParams
from onecat.engine.core import engine_core, sampler
from speculative_dflash import LOAD_LIMIT, machine_info

SETTINGS = {"top_p0.95": dict(temperature=0.8, top_p=0.95), "seed_route": dict(temperature=1.0, top_p=0.95, top_k=20),
            "temperature": dict(temperature=0.8)}
OUT = Path(__file__).parent / "results" / "sampling_cpu.json"


def load_baseline(tree: Path):
    path = tree / "engine" / "core" / "sampler.py"
    spec = importlib.util.spec_from_file_location("baseline_sampler", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def use(module) -> None:
    """Route the engine's sampling through `module` (engine_core imported the two functions by name)."""
    engine_core.sample, engine_core.apply_filters = module.sample, module.apply_filters


def prompt_logits(llm: LLM, n: int) -> torch.Tensor:
    """The model's next-token logits after n distinct short prompts, caught by a logits processor."""
    texts = [f"Question {i}: explain why the number {i * 7 + 3} is interesting, in one paragraph." for i in range(n)]
    caught: list[torch.Tensor] = []

    def catch(_output_ids, row):
        caught.append(row.detach().float().clone())
        return row

    llm.generate(texts, SamplingParams(temperature=0.0, max_tokens=1, logits_processors=[catch]))
    return torch.stack(caught)


def time_sample(module, logits: torch.Tensor, params: list[SamplingParams], calls: int) -> float:
    gens = [torch.Generator().manual_seed(i) for i in range(len(params))]
    module.sample(logits, params, gens)  # warm-up
    t0 = time.perf_counter()
    for _ in range(calls):
        module.sample(logits, params, gens)
    return (time.perf_counter() - t0) / calls


def decode(llm: LLM, n: int, setting: dict, max_tokens: int) -> float:
    """Sampled decode tok/s of n seeded requests together."""
    prompts = [f"Write a short story about a cat named {i}." for i in range(n)]
    params = [SamplingParams(**setting, seed=i, max_tokens=max_tokens, ignore_eos=True) for i in range(n)]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - t0
    return sum(len(o.token_ids) for o in outs) / seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline-tree", type=Path, required=True)
    ap.add_argument("--batch-sizes", default="16,64,256")
    ap.add_argument("--decode-batch", type=int, default=64)
    ap.add_argument("--decode-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--allow-loaded", action="store_true")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    load = os.getloadavg()[0]
    if load >= LOAD_LIMIT and not args.allow_loaded:
        raise SystemExit(f"load average {load:.2f} >= {LOAD_LIMIT}: not a quiet machine (--allow-loaded to go on)")
    arms = {"baseline": load_baseline(args.baseline_tree), "candidate": sampler}
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    llm = LLM("embedded:smollm2-135m-instruct", dtype="float32", max_model_len=512, max_num_seqs=max(sizes))
    logits = prompt_logits(llm, max(sizes))
    record = {"what": __doc__.splitlines()[0], "machine": machine_info("cpu"), "vocab": logits.shape[1],
              "sample_ms": {}, "decode_tok_s": {}, "calls": args.calls, "repeats": args.repeats}
    for name, setting in SETTINGS.items():
        for b in sizes:
            params = [SamplingParams(**setting, seed=i) for i in range(b)]
            runs = {arm: [] for arm in arms}
            for _ in range(args.repeats):
                for arm, module in arms.items():
                    runs[arm].append(time_sample(module, logits[:b], params, args.calls) * 1e3)
            row = {arm: round(statistics.median(v), 3) for arm, v in runs.items()}
            row["speedup"] = round(row["baseline"] / row["candidate"], 2)
            record["sample_ms"][f"{name}/b{b}"] = row
            print(f"sample() {name:12s} batch {b:4d}: " + ", ".join(f"{k} {v}" for k, v in row.items()), flush=True)
    for name, setting in SETTINGS.items():
        runs = {arm: [] for arm in arms}
        for _ in range(args.repeats):
            for arm, module in arms.items():
                use(module)
                runs[arm].append(decode(llm, args.decode_batch, setting, args.decode_tokens))
        use(sampler)
        row = {arm: round(statistics.median(v), 1) for arm, v in runs.items()}
        row["speedup"] = round(row["candidate"] / row["baseline"], 2)
        record["decode_tok_s"][f"{name}/b{args.decode_batch}"] = row
        print(f"decode {name:12s} batch {args.decode_batch}: " + ", ".join(f"{k} {v}" for k, v in row.items()),
              flush=True)
    record["machine"]["load_average_1m_end"] = os.getloadavg()[0]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"record: {args.out}")


if __name__ == "__main__":
    main()
