"""CPU engine benchmark on the embedded model: onecat vs HF transformers, measured in one run.

Workload (from the engine issue): 128-token prompts, 128 output tokens, greedy, EOS ignored.
  - transformers `generate`, batch 1 (the peer)
  - onecat, batch 1
  - onecat, 16 concurrent requests (continuous batching)
  - with --quantization gguf, also onecat batch 1 and 16 concurrent running the GGUF's own block
    tensors packed (4-bit matmuls; transformers cannot run them and dequantizes to --dtype)
Runs are interleaved (peer, onecat-1, onecat-16, repeated) and the median is reported, so slow
drift of a noisy machine hits every arm alike. Prints a table and writes a JSON record.

    python benchmarks/engine_cpu.py [--repeats 3] [--dtype float32] [--quantization gguf] [--out FILE]
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

from onecat.results.revision import git_revision

EMBEDDED = "embedded:smollm2-135m-instruct"
PROMPT_LEN, OUTPUT_LEN, CONCURRENCY = 128, 128, 16


def prompts(n: int, vocab_lo: int = 1000) -> list[list[int]]:
    """Deterministic, distinct token prompts (no shared prefix, so no prefix-cache help)."""
    return [[vocab_lo + (i * 131 + j * 7) % 40000 for j in range(PROMPT_LEN)] for i in range(n)]


def bench_transformers(model, ids: list[int]) -> dict:
    x = torch.tensor([ids])
    with torch.inference_mode():
        t0 = time.perf_counter()
        model(x)  # prefill alone, to split prefill from decode
        prefill = time.perf_counter() - t0
        t0 = time.perf_counter()
        out = model.generate(x, max_new_tokens=OUTPUT_LEN, min_new_tokens=OUTPUT_LEN, do_sample=False,
                             pad_token_id=0)
        total = time.perf_counter() - t0
    n = out.shape[1] - len(ids)
    return {"total_s": total, "output_tokens": n, "e2e_tok_s": n / total,
            "decode_tok_s": (n - 1) / max(total - prefill, 1e-9)}


def bench_onecat(llm, batch: list[list[int]]) -> dict:
    from onecat.engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=OUTPUT_LEN, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(batch, params)
    total = time.perf_counter() - t0
    n = sum(o.num_completion_tokens for o in outs)
    decode = statistics.median((o.num_completion_tokens - 1) / o.timings.decode_s for o in outs)
    return {"total_s": total, "output_tokens": n, "e2e_tok_s": n / total, "decode_tok_s_per_request": decode,
            "ttft_s": statistics.median(o.timings.first_token_s for o in outs)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/engine_cpu.json"))
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                    help="weights/activations for BOTH engines (matched precision)")
    ap.add_argument("--quantization", choices=["gguf"], default=None,
                    help="add onecat arms that keep the GGUF block tensors packed (quantization='gguf')")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)

    import transformers

    from onecat.engine import LLM
    from onecat.engine.model_source import resolve_model_source

    path = resolve_model_source(EMBEDDED).path
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                           dtype=dtype).eval()
    kw = dict(dtype=args.dtype, max_model_len=1024, max_num_seqs=CONCURRENCY, enable_prefix_caching=False)
    llm = LLM(EMBEDDED, **kw)
    packed = LLM(EMBEDDED, quantization=args.quantization, **kw) if args.quantization else None
    single, many = prompts(1)[0], prompts(CONCURRENCY)
    arms = {"transformers_b1": lambda: bench_transformers(hf, single),
            "onecat_b1": lambda: bench_onecat(llm, [single]), "onecat_c16": lambda: bench_onecat(llm, many)}
    if packed is not None:
        arms.update({"onecat_gguf_b1": lambda: bench_onecat(packed, [single]),
                     "onecat_gguf_c16": lambda: bench_onecat(packed, many)})
    for name in ("transformers_b1", "onecat_b1", "onecat_gguf_b1"):  # warm-up, excluded
        if name in arms:
            arms[name]()
    load_before = os.getloadavg()
    runs: dict[str, list] = {name: [] for name in arms}
    for r in range(args.repeats):
        for name, run in arms.items():
            runs[name].append(run())
        print(f"repeat {r + 1}/{args.repeats} done", flush=True)

    def med(arm, key):
        return statistics.median(x[key] for x in runs[arm])

    hf_dec, hf_e2e = med("transformers_b1", "decode_tok_s"), med("transformers_b1", "e2e_tok_s")
    one_dec, one_e2e = med("onecat_b1", "decode_tok_s_per_request"), med("onecat_b1", "e2e_tok_s")
    c16 = med("onecat_c16", "e2e_tok_s")
    summary = {
        "transformers_b1_decode_tok_s": hf_dec, "transformers_b1_e2e_tok_s": hf_e2e,
        "onecat_b1_decode_tok_s": one_dec, "onecat_b1_e2e_tok_s": one_e2e,
        "onecat_c16_aggregate_output_tok_s": c16,
        "ratio_b1_decode_vs_transformers": one_dec / hf_dec, "ratio_b1_e2e_vs_transformers": one_e2e / hf_e2e,
        "ratio_c16_aggregate_vs_transformers_b1": c16 / hf_e2e,
        "targets": {"b1_decode_ratio": 1.5, "c16_aggregate_ratio": 6.0},
    }
    if packed is not None:
        g_dec, g16 = med("onecat_gguf_b1", "decode_tok_s_per_request"), med("onecat_gguf_c16", "e2e_tok_s")
        summary.update({"onecat_gguf_b1_decode_tok_s": g_dec,
                        "onecat_gguf_b1_e2e_tok_s": med("onecat_gguf_b1", "e2e_tok_s"),
                        "onecat_gguf_c16_aggregate_output_tok_s": g16,
                        "ratio_gguf_b1_decode_vs_transformers": g_dec / hf_dec,
                        "ratio_gguf_c16_aggregate_vs_transformers_b1": g16 / hf_e2e,
                        "gguf_quantization": packed.info()["quantization"]})
    record = {
        "benchmark": "engine_cpu", "kind": "measured", "date": datetime.now(timezone.utc).isoformat(),
        "machine": {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                    "cores": os.cpu_count(), "python": platform.python_version(),
                    "load_average_1m_before_after": [load_before[0], os.getloadavg()[0]]},
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "onecat_git": git_revision()},
        "model": EMBEDDED, "dtype": args.dtype, "quantization": args.quantization,
        "precision_note": ("transformers and the onecat_b1/onecat_c16 arms run the GGUF dequantized to "
                           f"{args.dtype}; onecat_gguf_* arms run the same file's block tensors packed "
                           "(4-bit terms, bf16 matmul activations, everything else in "
                           f"{args.dtype})" if packed else f"both engines run the GGUF dequantized to {args.dtype}"),
        "workload": {"prompt_len": PROMPT_LEN, "output_len": OUTPUT_LEN,
                                                            "concurrency": CONCURRENCY, "greedy": True,
                                                            "ignore_eos": True, "repeats": args.repeats},
        "summary": summary, "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2))
    print(f"\n{'arm':<34}{'tok/s':>10}")
    print(f"{'transformers b1 decode':<34}{hf_dec:>10.1f}")
    print(f"{'transformers b1 end-to-end':<34}{hf_e2e:>10.1f}")
    print(f"{'onecat b1 decode':<34}{one_dec:>10.1f}   x{one_dec / hf_dec:.2f} (target 1.5)")
    print(f"{'onecat b1 end-to-end':<34}{one_e2e:>10.1f}   x{one_e2e / hf_e2e:.2f}")
    print(f"{'onecat 16 concurrent, aggregate':<34}{c16:>10.1f}   x{c16 / hf_e2e:.2f} vs transformers b1 (target 6)")
    if packed is not None:
        print(f"{'onecat gguf-packed b1 decode':<34}{g_dec:>10.1f}   x{g_dec / hf_dec:.2f} (target 1.5)")
        print(f"{'onecat gguf-packed 16 concurrent':<34}{g16:>10.1f}   x{g16 / hf_e2e:.2f} vs transformers b1")
    print(f"\nwritten: {args.out}")


if __name__ == "__main__":
    main()
