"""The packed CPU engine's many-row steps, arm against arm: a 16-sequence prefill step and the decode steps after it.

Each arm runs in its own process (the int8 path is chosen when the layers are built): the embedded model with
its GGUF tensors packed (quantization gguf), N distinct prompts of --prompt-len tokens, --output-len tokens
each, greedy. Per arm and run: the first engine step (all prompts' prefill, or its first chunk) and the median
decode step (all N sequences). Arms, interleaved over --repeats runs so slow drift of a shared box hits each:
  bf16-gemm   many-row steps on a bf16 GEMM over a dequantized copy (ONECAT_CPU_INT8_MATMUL=0), float32 KV
  int8        int8 dot products over the 4-bit codes (engine/quant/int4/int8_matmul.py), float32 KV
  int8-kvbf16 the same with kv_cache_dtype bfloat16
Prints a table and writes a JSON record with the machine and the load at each run's start.

    python benchmarks/cpu_packed_steps.py [--repeats 3] [--prompt-len 128] [--output-len 64] [--out FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

EMBEDDED = "embedded:smollm2-135m-instruct"
# arm: (environment, kv_cache_dtype, cpu_prompt_matmul)
ARMS = {"bf16-gemm": ({"ONECAT_CPU_INT8_MATMUL": "0"}, "auto", "int8"),
        "int8": ({"ONECAT_CPU_INT8_MATMUL": "1"}, "auto", "int8"),
        "int8-kvbf16": ({"ONECAT_CPU_INT8_MATMUL": "1"}, "bfloat16", "int8"),
        "amx-prompts": ({"ONECAT_CPU_INT8_MATMUL": "1"}, "bfloat16", "bf16")}


def run_arm(kv_cache_dtype: str, prompt_matmul: str, sequences: int, prompt_len: int, output_len: int) -> dict:
    """One arm in this process: (first step s, median decode step s, what the layers ran)."""
    from onecat.engine import LLM, SamplingParams

    with LLM(EMBEDDED, device="cpu", quantization="gguf", kv_cache_dtype=kv_cache_dtype, max_model_len=2048,
             max_num_seqs=sequences, enable_prefix_caching=False, cpu_prompt_matmul=prompt_matmul) as llm:
        params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
        prompts = [[1000 + (i * 131 + j * 7) % 40000 for j in range(prompt_len)] for i in range(sequences)]
        llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))  # warm-up
        for ids in prompts:
            llm.add_request(ids, params)
        steps = []
        while llm.engine.has_unfinished():
            t = time.perf_counter()
            llm.engine.step()
            steps.append(time.perf_counter() - t)
        prefill_steps = -(-sequences * prompt_len // llm.cfg.max_num_batched_tokens)
        info = llm.info()
        return {"first_step_s": steps[0], "decode_step_median_s": statistics.median(steps[prefill_steps + 1:]),
                "steps": len(steps), "large_batch_path": info["quantization"]["large_batch_path"],
                "kv_cache_dtype": info["kv_cache_dtype"], "cpu_isa": info["cpu_isa"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--sequences", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/cpu_packed_steps.json"))
    ap.add_argument("--arms", nargs="+", choices=list(ARMS), default=list(ARMS), help="the arms to run, in this order")
    ap.add_argument("--arm", help=argparse.SUPPRESS)  # internal: run one arm, print its JSON
    args = ap.parse_args()
    if args.arm:
        print(json.dumps(run_arm(*ARMS[args.arm][1:], args.sequences, args.prompt_len, args.output_len)))
        return
    from onecat.results.environment import load_1min, machine_record
    from onecat.results.revision import git_revision

    arms = {arm: ARMS[arm] for arm in args.arms}
    runs: dict[str, list[dict]] = {arm: [] for arm in arms}
    for _ in range(args.repeats):
        for arm, (env, *_) in arms.items():
            load = load_1min()
            out = subprocess.run([sys.executable, __file__, "--arm", arm, "--sequences", str(args.sequences),
                                  "--prompt-len", str(args.prompt_len), "--output-len", str(args.output_len)],
                                 env={**os.environ, **env}, capture_output=True, text=True, check=True)
            runs[arm].append({**json.loads(out.stdout.strip().splitlines()[-1]), "load_1min_at_start": load})
            r = runs[arm][-1]
            print(f"{arm:12s} first step {r['first_step_s']:.3f} s  decode step {r['decode_step_median_s'] * 1e3:.2f} ms"
                  f"  (load {load})", flush=True)
    summary = {arm: {"first_step_s_median": statistics.median(r["first_step_s"] for r in rs),
                     "decode_step_ms_median": statistics.median(r["decode_step_median_s"] for r in rs) * 1e3}
               for arm, rs in runs.items()}
    for arm, s in summary.items():
        print(f"{arm:12s} median first step {s['first_step_s_median']:.3f} s, decode step {s['decode_step_ms_median']:.2f} ms")
    record = {"benchmark": "cpu_packed_steps", "kind": "measured", "date": datetime.now(timezone.utc).isoformat(),
              "revision": git_revision(), "machine": machine_record(), "model": f"{EMBEDDED}, quantization gguf",
              "workload": {"sequences": args.sequences, "prompt_len": args.prompt_len, "output_len": args.output_len},
              "arms": {arm: {"env": env, "kv_cache_dtype": kv, "cpu_prompt_matmul": pm}
                       for arm, (env, kv, pm) in arms.items()},
              "summary": summary, "runs": runs}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"written: {args.out}")


if __name__ == "__main__":
    main()
