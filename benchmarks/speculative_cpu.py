"""Speculative vs target-only decoding on the embedded model (CPU), per proposer and workload.

Workloads: (a) repeated context: prompts that restate a code snippet and ask for it back with a small
edit (the answer repeats the prompt); (b) ordinary chat prompts. Greedy, so every arm must produce
the target-only tokens (checked here). Each proposer is measured in the same run as its target-only
peer, interleaved (peer, candidate, repeated), median of the repeats.

The draft_model arm drafts with the embedded model itself (no smaller model with the same tokenizer
ships offline): it shows the verifier's overhead at full acceptance, not a useful speedup. The
dflash arm uses a random-weight drafter (no trained drafter for this target exists): it shows the
plumbing cost at near-zero acceptance. Both are labelled so in the record.

    python benchmarks/speculative_cpu.py [--repeats 3] [--out benchmarks/results/speculative_cpu.json]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from onecat.engine import LLM, SamplingParams

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


def random_dflash(dirpath: Path, llm: LLM) -> Path:
    from safetensors.torch import save_file

    h = llm.model_config.hidden_size
    cfg = {"architectures": ["DFlashDraftModel"], "hidden_size": h, "intermediate_size": 512, "num_hidden_layers": 1,
           "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "rms_norm_eps": 1e-5,
           "rope_theta": 100000.0, "dflash_config": {"block_size": 5, "target_layer_ids": [1, 15, 28],
                                                      "mask_token_id": 0}}
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g) * 0.02  # noqa: E731
    w = {"fc.weight": r(h, 3 * h), "hidden_norm.weight": torch.ones(h), "norm.weight": torch.ones(h),
         "layers.0.self_attn.q_proj.weight": r(576, h), "layers.0.self_attn.k_proj.weight": r(192, h),
         "layers.0.self_attn.v_proj.weight": r(192, h), "layers.0.self_attn.o_proj.weight": r(h, 576),
         "layers.0.self_attn.q_norm.weight": torch.ones(64), "layers.0.self_attn.k_norm.weight": torch.ones(64),
         "layers.0.input_layernorm.weight": torch.ones(h), "layers.0.post_attention_layernorm.weight": torch.ones(h),
         "layers.0.mlp.gate_proj.weight": r(512, h), "layers.0.mlp.up_proj.weight": r(512, h),
         "layers.0.mlp.down_proj.weight": r(h, 512)}
    dirpath.mkdir(parents=True, exist_ok=True)
    (dirpath / "config.json").write_text(json.dumps(cfg))
    save_file({k: v.contiguous() for k, v in w.items()}, str(dirpath / "model.safetensors"))
    return dirpath


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/speculative_cpu.json"))
    ap.add_argument("--threads", type=int, default=None, help="torch threads (1 avoids spin on a shared CPU)")
    ap.add_argument("--proposers", default=None, help="comma-separated subset of the proposer names")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    base = LLM(EMBEDDED, max_model_len=1024, enable_prefix_caching=False)
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
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    loads = workloads(base)
    rows = []
    for name, cfg in proposers.items():
        spec = LLM(EMBEDDED, max_model_len=1024, enable_prefix_caching=False, speculative_config=cfg)
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
    record = {"benchmark": "speculative_cpu", "kind": "measured", "date": datetime.now(timezone.utc).isoformat(),
              "machine": {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                          "cores": os.cpu_count(), "load_average_1m_end": os.getloadavg()[0]},
              "versions": {"torch": torch.__version__}, "model": EMBEDDED, "dtype": "float32", "greedy": True,
              "batch_size": 1, "max_tokens": args.max_tokens, "repeats": args.repeats, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2))
    print(f"written: {args.out}")


if __name__ == "__main__":
    main()
