"""What a revision worker costs: decode tok/s of the embedded model in-process vs through the worker.

Both engines are open at once, in this run: the in-process onecat engine (gates/engines/onecat_engine.py)
and the same working tree's engine behind a worker process (gates/engines/revision_engine.py, the path
both arms take when a contract pins code). Repeats alternate in-process / worker so drift hits both.
Decode tok/s is the engine's own timing (first token -> last, per request); wall tok/s adds the pipe,
the pickling and the rebuilding of outputs. Writes benchmarks/results/revision_worker.json.

    python benchmarks/revision_worker.py [--repeats 5] [--batch 1] [--threads N] [--out FILE]

--threads sets the torch threads of both engines (OMP_NUM_THREADS for the worker): on a shared CPU,
one thread each keeps another process's load from stalling a spinning thread pool.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path

from onecat.engine import SamplingParams
from onecat.gates.contract import parse_contract
from onecat.gates.engines.onecat_engine import OnecatEngine
from onecat.gates.engines.revision_engine import RevisionEngine
from onecat.gates.revision.resolve import working_tree_code
from onecat.results.revision import REPO_ROOT, git_revision

PROMPT_LEN, OUTPUT_LEN = 64, 64
CONTRACT = {"name": "revision-worker-bench", "model": {"source": "embedded:smollm2-135m-instruct", "dtype": "float32"},
            "engine": {"device": "cpu", "max_model_len": 512, "max_num_seqs": 16},
            "workloads": [{"kind": "ppl", "dataset": "calibration_wiki", "segments": 2, "segment_len": 64}], "gates": [{"check": "ppl_delta",
                                                                                      "max_relative": 0.01}]}


def measure(engine, prompts: list[list[int]]) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=OUTPUT_LEN, ignore_eos=True)
    t0 = time.perf_counter()
    outs = engine.generate(prompts, [params] * len(prompts))
    wall = time.perf_counter() - t0
    decoded = sum(len(o.token_ids) - 1 for o in outs)
    first = min(o.timings.first_token_s for o in outs)
    last = max(o.timings.e2e_s for o in outs)
    return {"decode_tok_s": decoded / (last - first), "wall_tok_s": sum(len(o.token_ids) for o in outs) / wall,
            "token_ids": [o.token_ids for o in outs]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--threads", type=int, default=None, help="torch threads of each engine (default: torch's)")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "revision_worker.json")
    args = ap.parse_args()
    load_before = os.getloadavg()[0]
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the worker inherits it
    arm = parse_contract(CONTRACT).arm("candidate")
    prompts = [[1000 + (i * 131 + j * 7) % 40000 for j in range(PROMPT_LEN)] for i in range(args.batch)]
    t0 = time.perf_counter()
    in_process = OnecatEngine.open(arm)
    worker = RevisionEngine.open(arm.model_copy(update={"code": working_tree_code(REPO_ROOT)}))
    open_s = time.perf_counter() - t0
    runs: dict[str, list[dict]] = {"in_process": [], "worker": []}
    try:
        for engine in (in_process, worker):
            measure(engine, prompts)  # warm-up
        for _ in range(args.repeats):
            runs["in_process"].append(measure(in_process, prompts))
            runs["worker"].append(measure(worker, prompts))
    finally:
        in_process.close()
        worker.close()
    same_tokens = all(a["token_ids"] == b["token_ids"] for a, b in zip(runs["in_process"], runs["worker"]))
    summary = {path: {m: statistics.median(r[m] for r in rs) for m in ("decode_tok_s", "wall_tok_s")}
               for path, rs in runs.items()}
    record = {
        "benchmark": "revision_worker", "when": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "revision": git_revision(), "machine": {"cpu": platform.processor() or platform.machine(),
                                                "threads": os.cpu_count(), "load_before": load_before,
                                                "load_after": os.getloadavg()[0]},
        "workload": {"model": CONTRACT["model"]["source"], "prompt_len": PROMPT_LEN, "output_len": OUTPUT_LEN,
                     "batch": args.batch, "repeats": args.repeats, "greedy": True, "threads": args.threads},
        "open_both_s": open_s, "same_tokens": same_tokens,
        "median": summary,
        "worker_over_in_process": {m: summary["worker"][m] / summary["in_process"][m]
                                   for m in ("decode_tok_s", "wall_tok_s")},
        "repeats": {path: [{m: r[m] for m in ("decode_tok_s", "wall_tok_s")} for r in rs]
                    for path, rs in runs.items()},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    for path, s in summary.items():
        print(f"{path:<11} decode {s['decode_tok_s']:7.2f} tok/s   wall {s['wall_tok_s']:7.2f} tok/s")
    print(f"worker / in-process: {record['worker_over_in_process']}; same tokens: {same_tokens}; load before "
          f"{load_before:.2f}; wrote {args.out}")


if __name__ == "__main__":
    main()
