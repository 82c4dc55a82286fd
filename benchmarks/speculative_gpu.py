"""DFlash vs target-only decoding on CUDA: the embedded SmolLM2-135M target, batch 1 and batch 8.

One command measures everything and prints one summary line per figure (prompt set x batch size):
target-only and DFlash decode tok/s, their ratio, acceptance length (tokens per verify round, the
bonus token included), per-position acceptance and token identity on every prompt
(benchmarks/speculative_dflash.py defines each figure). Both engines run the same target settings:
the dtype the engine picks on CUDA (`auto`: the checkpoint's half type), CUDA graphs on
(`cuda_graph: full`), prefix caching off, greedy, 128 new tokens; the arms alternate per repeat, after
both engines ran each prompt set once un-timed at each batch size (the speculative engine's gate learns a
batch size's costs once per engine, as its graphs are captured once).
Repeats stop early (never below one per figure) once --budget-s has passed, so the run stays
under 4 minutes on an H200; the record says how many ran.

On the GPU machine (the GGUF and the drafter carried there; the prompts saved beforehand where the
datasets are, since that machine has no network):
    python benchmarks/speculative_gpu.py --save-prompts .onecat/dflash_prompts.json      # here
    python benchmarks/speculative_gpu.py --target SmolLM2-135M-Instruct.Q4_1.gguf \\
        --drafter engine/drafters/smollm2-135m-dflash --prompts .onecat/dflash_prompts.json [--drafter-cuda-graphs off]
The same logic runs on CPU for a check of the plumbing:
    python benchmarks/speculative_gpu.py --device cpu --max-prompts 2 --drafter random --max-tokens 16
"""
from __future__ import annotations

import argparse
import os
import time
from datetime import datetime, timezone
from pathlib import Path

from speculative_dflash import (EMBEDDED_DRAFTER, EMBEDDED_TARGET, SAMPLING, check_drafter, compare, drafter_info,
                                load_prompts, log, machine_info, open_pair, save_prompts, select_prompts, write_record)


def engine_settings(device: str, batch_sizes: list[int]) -> dict:
    """The target settings both arms share; CUDA graphs and a fixed KV budget (two engines share the GPU) on CUDA."""
    settings = dict(device=device, dtype="auto" if device.startswith("cuda") else "float32", max_model_len=1024,
                    max_num_seqs=max(batch_sizes), enable_prefix_caching=False, kv_cache_memory_gb=2.0)
    if device.startswith("cuda"):
        settings["cuda_graph"] = "full"
    return settings


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=EMBEDDED_TARGET, help="the embedded GGUF's path (or embedded name)")
    ap.add_argument("--drafter", default=EMBEDDED_DRAFTER, help="drafter directory, embedded name, or 'random'")
    ap.add_argument("--num-speculative-tokens", type=int, default=7, help="drafts per round (block size - 1)")
    ap.add_argument("--device", default="cuda", help="cuda | cuda:N | cpu (cpu: a logic check, not a figure)")
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--max-prompts", type=int, default=16, help="prompts per set (GSM8K, HumanEval+)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--budget-s", type=float, default=180.0, help="start no new repeat after this many seconds")
    ap.add_argument("--prompts", type=Path, default=None, help="prompts saved with --save-prompts")
    ap.add_argument("--save-prompts", type=Path, default=None, help="write the selected prompts to FILE and stop")
    ap.add_argument("--drafter-cuda-graphs", choices=("on", "off"), default="on",
                    help="replay the drafter's block forward from CUDA graphs (the default where the target "
                         "replays its own; off sets ONECAT_DFLASH_CUDA_GRAPHS=0)")
    ap.add_argument("--draft-vocab-size", type=int, default=None,
                    help="drafts over the drafter's N ranked ids plus each request's own tokens (draft_vocab.json)")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/speculative_gpu_dflash.json"))
    ap.add_argument("--profile", type=Path, default=None, metavar="DIR",
                    help="instead of measuring: where target-only's steps and DFlash's rounds go at batch 1 "
                         "(benchmarks/round_timeline.py), into DIR/timeline.json")
    ap.add_argument("--sampling", choices=sorted(SAMPLING), default="greedy",
                    help="greedy (tokens checked against target-only), or seed_route: T 1.0, top-p 0.95, top-k 20, a "
                         "seed per prompt (draws keyed by seed and position: tokens checked against target-only too)")
    ap.add_argument("--gate", choices=("on", "off"), default="on",
                    help="on: the engine's default, drafting only while it pays (speculative_config."
                         "disable_when_slower); off: every round drafts (what a round costs)")
    args = ap.parse_args()
    from onecat.engine.speculative.dflash_graphs import ENV_FLAG

    os.environ[ENV_FLAG] = "1" if args.drafter_cuda_graphs == "on" else "0"  # read when the DFlash proposer is built
    t0 = time.time()
    if args.save_prompts:
        save_prompts(select_prompts(args.max_prompts), args.save_prompts)
        log(f"prompts written: {args.save_prompts}")
        return
    check_drafter(args.drafter)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    prompts = load_prompts(args.prompts, args.max_prompts) if args.prompts else select_prompts(args.max_prompts)
    settings = engine_settings(args.device, batch_sizes)
    base, spec, label = open_pair(args.target, args.drafter, args.num_speculative_tokens, gate=args.gate == "on",
                                  draft_vocab_size=args.draft_vocab_size, **settings)
    info = spec.info()
    log(f"engines open in {time.time() - t0:.0f}s: {info['device_name']}, dtype {info['dtype']}, cuda graphs "
        f"{info['cuda_graph']} (drafter: {info['speculative'].get('cuda_graphs')}), drafter {label}")
    if args.profile:
        profile_dflash(base, spec, prompts, args.max_tokens, args.profile, args.sampling)
        return
    rows = compare(base, spec, prompts, batch_sizes, args.max_tokens, args.repeats, deadline=t0 + args.budget_s,
                   warm_whole_set=True, sampling=args.sampling)
    record = {"benchmark": "speculative_gpu_dflash", "kind": "measured",
              "measured_on": info["device_name"] if args.device != "cpu" else "cpu (logic check, not a GPU figure)",
              "date": datetime.now(timezone.utc).isoformat(), "machine": machine_info(args.device),
              "target": args.target, "drafter": drafter_info(spec, label), "gate": args.gate,
              "engine": {**settings, "effective_dtype": info["dtype"], "cuda_graph_used": info["cuda_graph"],
                         "target_only_cuda_graph_used": base.info()["cuda_graph"],
                         "attention_backend": info["attention_backend"]},
              "prompts": prompts["datasets"], "greedy": args.sampling == "greedy",
              "sampling": {"name": args.sampling, **SAMPLING[args.sampling]}, "max_tokens": args.max_tokens,
              "warmup": "each prompt set once per batch size, un-timed, for both engines",
              "repeats_asked": args.repeats, "budget_s": args.budget_s, "rows": rows, "wall_s": time.time() - t0,
              # Triton kernel variants built after each engine's warm-up (each fell on a step of a run above)
              "kernel_variants_built_after_warmup": {"target_only": base.info()["kernel_variants_built_after_warmup"],
                                                     "dflash": spec.info()["kernel_variants_built_after_warmup"]}}
    write_record(record, args.out)  # compare() printed one summary line per figure as it measured it
    log(f"done in {time.time() - t0:.0f}s")


def profile_dflash(base, spec, prompts: dict, max_tokens: int, out: Path, sampling: str = "greedy") -> None:
    """Where target-only's steps and DFlash's rounds go at batch 1 (benchmarks/round_timeline.py: device-busy
    time per step, the device's idle time by host phase), after a warm-up; into DIR/timeline.json."""
    import json

    from round_timeline import profile_steps
    from speculative_dflash import run_batches, token_ids

    ids = [token_ids(spec, p) for p in next(iter(prompts["sets"].values()))[:4]]
    summaries = {}
    for label, llm in (("target_only", base), ("dflash", spec)):
        run_batches(llm, ids[:1], 1, max_tokens, sampling)  # warm-up: compiles, graph captures, allocator
        summaries[label] = profile_steps(lambda llm=llm: run_batches(llm, ids, 1, max_tokens, sampling), out, label)
        s = summaries[label]
        log(f"{label}: {s['wall_per_step_us']:.0f} us a step, device busy {s['device_busy_per_step_us']:.0f}; "
            f"idle by host phase {s['idle_per_step_us_by_host_phase']}")
    (out / "timeline.json").write_text(json.dumps(summaries, indent=1) + "\n")


if __name__ == "__main__":
    main()
