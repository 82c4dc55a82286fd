"""Tensor parallel on CPU: the embedded model on one rank vs split over N gloo ranks, same run.

Both engines are open at once and measured alternately (TP=1, TP=N, TP=1, ...) so drift hits both.
Threads: TP=1 uses every core the process may use; each TP rank takes its share (rank 0 in this
process, the others in their worker processes), so both arms use the same cores. Greedy, ignore_eos,
64-token prompts, 64 new tokens; decode tok/s is the engine's own timing (first token -> last). Token
identity with TP=1 is checked on every repeat; the cost of one all-reduce (gloo and shared memory) is
measured apart. Writes benchmarks/results/tp_cpu.json.

    python benchmarks/tp_cpu.py [--tp 2] [--batch-sizes 1,8] [--repeats 3]

What it says: whether the split model gives the same tokens, and what splitting costs or gains on a
CPU, where the ranks share one memory bus (no speed-up is expected on a 2-core box; the collectives
and the step message are the cost).
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

import torch

from onecat.engine import LLM, SamplingParams
from onecat.engine.parallel.collectives import SharedMemoryRanks, shm_name
from onecat.engine.parallel.runtime import threads_per_rank

PROMPT_LEN, OUTPUT_LEN = 64, 64


def measure(llm: LLM, prompts: list[list[int]]) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=OUTPUT_LEN, ignore_eos=True)
    outs = llm.engine_generate(prompts, [params] * len(prompts))
    decoded = sum(len(o.token_ids) - 1 for o in outs)
    first = min(o.timings.first_token_s for o in outs)
    last = max(o.timings.e2e_s for o in outs)
    return {"decode_tok_s": decoded / (last - first), "token_ids": [o.token_ids for o in outs]}


def _allreduce_rank(rank: int, world: int, port: int, hidden: int, rows: list[int], calls: int, out) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    if rank == 0:
        shm = SharedMemoryRanks(shm_name(port), rank, world, create=True)
    dist.barrier()
    if rank != 0:
        shm = SharedMemoryRanks(shm_name(port), rank, world, create=False)
    result = {}
    for path, reduce in (("gloo", dist.all_reduce), ("shared_memory", shm.all_reduce)):
        for n in rows:
            x = torch.ones(n, hidden)
            for _ in range(20):
                reduce(x)
            dist.barrier()
            t = time.perf_counter()
            for _ in range(calls):
                reduce(x)
            result[f"{path}_rows_{n}"] = round(1e6 * (time.perf_counter() - t) / calls, 1)
    dist.barrier()
    shm.close()
    if rank == 0:
        out.put(result)
    dist.destroy_process_group()


def allreduce_cost(world: int, hidden: int, rows: list[int], calls: int = 500) -> dict:
    """Microseconds per all-reduce of [rows, hidden] float32 between `world` fresh processes (one thread
    each), through gloo and through the shared-memory path the engine uses on CPU: what every
    row-parallel layer pays per step."""
    import multiprocessing as mp

    from onecat.engine.parallel.runtime import free_port

    ctx = mp.get_context("spawn")
    out, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_allreduce_rank, args=(r, world, port, hidden, rows, calls, out)) for r in range(world)]
    for p in procs:
        p.start()
    result = out.get(timeout=300)
    for p in procs:
        p.join()
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "tp_cpu.json")
    args = ap.parse_args()
    t0 = time.perf_counter()
    load_before = os.getloadavg()[0]
    print(f"load average before: {load_before:.2f}", flush=True)
    all_threads = torch.get_num_threads()
    settings = dict(device="cpu", max_model_len=512, max_num_seqs=16)
    one = LLM("embedded:smollm2-135m-instruct", **settings)
    split = LLM("embedded:smollm2-135m-instruct", tensor_parallel_size=args.tp, **settings)
    rank_threads = threads_per_rank(args.tp)
    vocab = one.model_config.vocab_size
    g = torch.Generator().manual_seed(0)
    rows = []
    try:
        for bs in [int(b) for b in args.batch_sizes.split(",")]:
            prompts = torch.randint(100, vocab - 100, (bs, PROMPT_LEN), generator=g).tolist()
            figures = {"tp1": [], f"tp{args.tp}": []}
            identical = True
            for _ in range(args.repeats):
                torch.set_num_threads(all_threads)
                a = measure(one, prompts)
                torch.set_num_threads(rank_threads)
                b = measure(split, prompts)
                figures["tp1"].append(a["decode_tok_s"])
                figures[f"tp{args.tp}"].append(b["decode_tok_s"])
                identical &= a["token_ids"] == b["token_ids"]
            med = {k: statistics.median(v) for k, v in figures.items()}
            row = {"batch_size": bs, "decode_tok_s": med, "per_repeat": figures,
                   "ratio": med[f"tp{args.tp}"] / med["tp1"], "tokens_identical": identical}
            rows.append(row)
            print(f"bs={bs:<3} TP=1 {med['tp1']:7.1f} tok/s   TP={args.tp} {med[f'tp{args.tp}']:7.1f} tok/s   "
                  f"x{row['ratio']:.2f}   identical {identical}", flush=True)
        info = split.info()["tensor_parallel"]
    finally:
        split.close()
        one.close()
    collective_us = allreduce_cost(args.tp, one.model_config.hidden_size, [1, 8])
    per_step = 2 * one.model_config.num_hidden_layers + 2  # o_proj and down_proj per layer, embedding, LM head
    print(f"all-reduce of one hidden row: gloo {collective_us['gloo_rows_1']:.0f} us, shared memory "
          f"{collective_us['shared_memory_rows_1']:.0f} us; {per_step} collectives per step", flush=True)
    record = {"benchmark": "tp_cpu", "kind": "measured", "measured_on": f"{platform.machine()} CPU, "
              f"{os.cpu_count()} cores", "date": datetime.now(timezone.utc).isoformat(),
              "machine": {"cores": os.cpu_count(), "threads_tp1": all_threads, "threads_per_rank": rank_threads,
                          "load_average_1m_start": load_before, "load_average_1m_end": os.getloadavg()[0],
                          "torch": torch.__version__},
              "model": "embedded:smollm2-135m-instruct (float32, dequantized GGUF)", "tensor_parallel": info,
              "collective_us": collective_us, "collectives_per_step": per_step,
              "prompt_len": PROMPT_LEN, "output_len": OUTPUT_LEN, "repeats": args.repeats, "rows": rows,
              "wall_s": round(time.perf_counter() - t0, 1)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"written: {args.out}")


if __name__ == "__main__":
    main()
