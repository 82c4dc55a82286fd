"""Speculative vs target-only decoding on the embedded model (CPU), batch 1, greedy.

--arm proposers (default): every proposer on two workloads: (a) repeated context: prompts that
restate a code snippet and ask for it back with a small edit (the answer repeats the prompt); (b)
ordinary chat prompts. Each proposer is measured in the same run as its target-only peer,
interleaved (peer, candidate, repeated), median of the repeats; greedy, so every arm must produce the
target-only tokens (checked here). The draft_model arm drafts with the embedded model itself (no
smaller model with the same tokenizer ships offline): it shows the verifier's overhead at full
acceptance, not a useful speedup. The dflash arm there uses a random-weight drafter: it shows the
plumbing cost at near-zero acceptance. Both are labelled so in the record.

--arm dflash: the trained DFlash drafter (--drafter, default embedded:smollm2-135m-dflash; "random"
for a random-weight one) against target-only on held-out chat prompts (GSM8K test questions and
HumanEval+ tasks, benchmarks/speculative_dflash.py says how and what each figure means), 128 new
tokens, every prompt token-checked; written to benchmarks/results/speculative_cpu_dflash.json.

The 1-minute load average is printed at the start; at LOAD_LIMIT or above the script refuses to
measure (timings on a busy 2-core CPU mean little) unless --allow-loaded, which marks the record.

    python benchmarks/speculative_cpu.py [--repeats 3] [--threads 2]
    python benchmarks/speculative_cpu.py --arm dflash [--drafter DIR] [--max-prompts 8] [--threads 2]
        [--draft-vocab-sizes 0,4096]  (drafter arms over draft vocabularies, each against target-only)
    --packed (either arm): the target as the CPU server runs it (4-bit tensors packed, bfloat16 KV cache);
    --drafter-quantization w4a16 (dflash arm): the drafter's linears on the CPU's int4 layer
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from onecat.engine import LLM, SamplingParams
from speculative_dflash import (EMBEDDED_DRAFTER, LOAD_LIMIT, SAMPLING, check_drafter, compare, drafter_info,
                                load_prompts, machine_info, open_pair, random_dflash, select_prompts, write_record)

EMBEDDED = "embedded:smollm2-135m-instruct"
SNIPPETS = [
    "def mean(xs):\n    total = 0\n    for x in xs:\n        total += x\n    return total / len(xs)\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, x):\n        self.items.append(x)\n"
    "\n    def pop(self):\n        return self.items.pop()\n",
    "def is_prime(n):\n    if n < 2:\n        return False\n    for d in range(2, int(n ** 0.5) + 1):\n"
    "        if n % d == 0:\n            return False\n    return True\n",
    "def read_lines(path):\n    with open(path) as fh:\n        return [line.rstrip('\\n') for line in fh]\n",
]
CHAT = ["What is the tallest mountain in Europe?", "Give me three tips for learning a new language.",
        "Explain what a binary search does.", "Write a haiku about autumn."]


def workloads(llm: LLM) -> dict[str, list[list[int]]]:
    tok = llm.tokenizer

    def chat(text):
        return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]), add_special_tokens=False)

    edit = [chat(f"Rename the function's variables to be more descriptive but keep everything else the same. "
                 f"Reply with the full code only.\n\n```python\n{s}```") for s in SNIPPETS]
    return {"repeated_context": edit, "chat": [chat(c) for c in CHAT]}


def run(llm: LLM, prompts, params) -> dict:
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - t0
    decoded = sum(o.num_completion_tokens - 1 for o in outs)
    decode_time = sum(o.timings.decode_s for o in outs)
    drafts = sum(o.spec.num_drafts for o in outs)
    acc = sum(o.spec.num_accepted_tokens for o in outs)
    return {"wall_s": wall, "decode_tok_s": decoded / max(decode_time, 1e-9), "tokens": [o.token_ids for o in outs],
            "acceptance_length": 1 + acc / drafts if drafts else None, "drafts": drafts, "accepted": acc}


def target_settings(args) -> dict:
    """The target's engine settings, the same for both engines of a pair."""
    settings = dict(device="cpu", dtype="float32", max_model_len=1024, enable_prefix_caching=False)
    if args.packed:  # the served CPU setting (contracts/peers_cpu.yaml's onecat-packed)
        settings.update(quantization="gguf", kv_cache_dtype="bfloat16")
    return settings


def proposers_arm(args) -> dict:
    settings = target_settings(args)
    base = LLM(EMBEDDED, **settings)
    tmp = Path(tempfile.mkdtemp())
    proposers = {
        "ngram_k4": {"method": "ngram", "num_speculative_tokens": 4},
        "ngram_adaptive_2to8": {"method": "ngram", "num_speculative_tokens": 2, "adaptive": True,
                                "max_speculative_tokens": 8},
        "draft_model_self_k3 (full-acceptance overhead)": {"method": "draft_model", "num_speculative_tokens": 3,
                                                           "model": EMBEDDED},
        "dflash_random_weights_k4 (plumbing cost)": {"method": "dflash", "num_speculative_tokens": 4,
                                                     "model": str(random_dflash(tmp / "dflash", base))},
    }
    if args.proposers:
        wanted = args.proposers.split(",")
        proposers = {k: v for k, v in proposers.items() if k.split(" ")[0] in wanted}
    max_tokens = args.max_tokens or 96
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    loads = workloads(base)
    rows = []
    for name, cfg in proposers.items():
        spec = LLM(EMBEDDED, **settings, speculative_config=cfg)
        for wl, prompts in loads.items():
            for p in prompts[:1]:  # warm-up
                run(base, [p], params), run(spec, [p], params)
            b_runs, s_runs = [], []
            for _ in range(args.repeats):
                for p in prompts:  # batch 1, one request at a time
                    b_runs.append(run(base, [p], params))
                    s_runs.append(run(spec, [p], params))
            identical = all(b["tokens"] == s["tokens"] for b, s in zip(b_runs, s_runs))
            b = statistics.median(r["decode_tok_s"] for r in b_runs)
            s = statistics.median(r["decode_tok_s"] for r in s_runs)
            drafts = sum(r["drafts"] for r in s_runs)
            acc_len = 1 + sum(r["accepted"] for r in s_runs) / drafts if drafts else None
            rows.append({"proposer": name, "workload": wl, "target_only_decode_tok_s": b,
                         "speculative_decode_tok_s": s, "ratio": s / b, "acceptance_length": acc_len,
                         "tokens_identical": identical})
            print(f"{name:<48}{wl:<18} target-only {b:7.1f} tok/s  speculative {s:7.1f} tok/s  x{s / b:.2f}  "
                  f"acceptance {acc_len if acc_len is None else round(acc_len, 2)}  identical={identical}", flush=True)
        spec.close()
    return {"benchmark": "speculative_cpu", "model": EMBEDDED, "target_settings": settings, "greedy": True,
            "batch_size": 1,
            "max_tokens": max_tokens, "repeats": args.repeats, "rows": rows}


def dflash_arm(args) -> dict:
    """Trained DFlash drafter vs target-only on held-out chat prompts, batch 1 (speculative_dflash.compare)."""
    check_drafter(args.drafter)
    prompts = load_prompts(args.prompts, args.max_prompts) if args.prompts else select_prompts(args.max_prompts)
    settings = target_settings(args)
    sizes = args.draft_vocab_sizes or [0]
    max_tokens = args.max_tokens or 128
    rows, drafters, base = [], {}, None
    for size in sizes:  # each size against the same target-only engine, interleaved with it
        pair = open_pair(args.target, args.drafter, args.num_speculative_tokens, not args.no_gate, size,
                         args.drafter_quantization, **settings)
        if base is None:
            base = pair[0]
        else:
            pair[0].close()
        spec, label = pair[1], pair[2]
        for row in compare(base, spec, prompts, [1], max_tokens, args.repeats, sampling=args.sampling):
            rows.append({"draft_vocab_size": size or None, **row})
        drafters[size or "whole vocabulary"] = drafter_info(spec, label)
        engine = {k: spec.info()[k] for k in ("device", "dtype", "attention_backend", "cuda_graph")}
        spec.close()
    return {"benchmark": "speculative_cpu_dflash", "target": args.target, "target_settings": settings,
            "drafter_quantization": args.drafter_quantization,
            "drafter": drafters[sizes[0] or "whole vocabulary"] if len(sizes) == 1 else drafters, "engine": engine,
            "prompts": prompts["datasets"], "greedy": args.sampling == "greedy",
            "sampling": {"name": args.sampling, **SAMPLING[args.sampling]}, "batch_size": 1, "max_tokens": max_tokens,
            "repeats": args.repeats, "rows": rows}


def load_gate(allow_loaded: bool) -> float:
    """Prints the machine's load; refuses a busy one unless allowed. Returns the 1-minute load average."""
    try:
        print(subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip(), flush=True)
    except OSError:
        pass
    load = os.getloadavg()[0]
    if load >= LOAD_LIMIT and not allow_loaded:
        raise SystemExit(f"load average {load:.2f} >= {LOAD_LIMIT}: timings on a busy CPU are not recorded. Wait "
                         "for a quiet machine, or pass --allow-loaded (the record is then marked as measured under "
                         "load)")
    return load


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arm", choices=["proposers", "dflash"], default="proposers")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=None, help="new tokens per request (proposers 96, dflash 128)")
    ap.add_argument("--out", type=Path, default=None, help="default benchmarks/results/speculative_cpu[_dflash].json")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (1 avoids spin on a shared CPU)")
    ap.add_argument("--proposers", default=None, help="proposers arm: comma-separated subset of the proposer names")
    ap.add_argument("--target", default=EMBEDDED, help="dflash arm: target model (embedded name, .gguf, HF dir)")
    ap.add_argument("--drafter", default=EMBEDDED_DRAFTER, help="dflash arm: drafter directory, embedded name, or "
                                                                "'random' (random weights: plumbing only)")
    ap.add_argument("--num-speculative-tokens", type=int, default=7, help="dflash arm: drafts per round (block - 1)")
    ap.add_argument("--max-prompts", type=int, default=8, help="dflash arm: prompts per set (GSM8K, HumanEval+)")
    ap.add_argument("--draft-vocab-sizes", type=lambda s: [int(x) for x in s.split(",")], default=None,
                    help="dflash arm: drafter arms, each a draft_vocab_size (0: the whole vocabulary), e.g. 0,4096")
    ap.add_argument("--prompts", type=Path, default=None, help="dflash arm: prompts saved by speculative_gpu.py "
                                                               "--save-prompts (instead of the datasets)")
    ap.add_argument("--sampling", choices=sorted(SAMPLING), default="greedy",
                    help="dflash arm: greedy (tokens checked against target-only), or seed_route: T 1.0, top-p 0.95, "
                         "top-k 20, a seed per prompt (keyed draws: tokens checked against target-only too)")
    ap.add_argument("--no-gate", action="store_true",
                    help="dflash arm: draft every round (disable_when_slower false), as the drafter contracts do")
    ap.add_argument("--packed", action="store_true",
                    help="both arms: the target's 4-bit tensors kept packed (quantization gguf) with a bfloat16 KV "
                         "cache, as the CPU server runs it")
    ap.add_argument("--drafter-quantization", choices=("fp8", "nvfp4", "mxfp4", "w4a16"), default=None,
                    help="dflash arm: the drafter's linears quantized at load (w4a16 runs on the CPU's int4 layer)")
    ap.add_argument("--allow-loaded", action="store_true", help=f"measure even at load >= {LOAD_LIMIT} (marked)")
    args = ap.parse_args()
    load = load_gate(args.allow_loaded)
    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.time()
    machine = machine_info("cpu")
    record = dflash_arm(args) if args.arm == "dflash" else proposers_arm(args)
    machine["load_average_1m_end"] = os.getloadavg()[0]
    record = {**record, "kind": "measured", "date": datetime.now(timezone.utc).isoformat(),
              "machine": machine, "wall_s": time.time() - t0,
              "quiet_machine": max(load, machine["load_average_1m_end"]) < LOAD_LIMIT}
    if not record["quiet_machine"]:
        record["warning"] = f"measured under load (1-minute load average reached {LOAD_LIMIT} or more)"
    name = "speculative_cpu_dflash.json" if args.arm == "dflash" else "speculative_cpu.json"
    write_record(record, args.out or Path("benchmarks/results") / name)


if __name__ == "__main__":
    main()
