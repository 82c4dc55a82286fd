"""Where a batch-1 decode step's time goes on the GPU: kernel time by kernel, and GPU-busy share.

    python benchmarks/gpu_step_profile.py [--shape llama3-8b] [--ctx 1024] [--steps 32] [--quantization w4a16]
        [--no-pdl] [--out FILE]

Random-init weights of an 8B shape (as benchmarks/gpu_decode.py). Profiles `--steps` decode steps
with CUDA graphs on (graph replays show their kernels) and reports: wall time per step, summed
kernel time per step (the GPU-busy share is their ratio: the rest is host work the GPU waits for),
the top kernels by total time and, per decode step (the prefill's kernels subtracted by name), the kernels'
calls and time; then a cProfile of the host side of the same decode. Under PDL a kernel's time includes its
wait for the previous one: --no-pdl for a breakdown.
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from gpu_decode import SHAPES, build_onecat, make_model_dir, prompts


def host_profile(llm, prompt, steps: int) -> list[dict]:
    """cProfile of the same decode: which host functions take the time the GPU waits for."""
    import cProfile
    import pstats

    from onecat.engine import SamplingParams

    prof = cProfile.Profile()
    prof.enable()
    llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True))
    torch.cuda.synchronize()
    prof.disable()
    stats = pstats.Stats(prof)
    rows = []
    for (file, line, fn), (_, ncalls, tottime, cumtime, _) in stats.stats.items():
        rows.append({"function": f"{Path(file).name}:{line}:{fn}", "calls": ncalls,
                     "self_ms_per_step": 1e3 * tottime / steps, "cum_ms_per_step": 1e3 * cumtime / steps})
    return sorted(rows, key=lambda r: -r["cum_ms_per_step"])[:40]


def kernel_gaps(prof) -> dict:
    """Idle time between consecutive kernels on the GPU (launch latency, ramp-up and tail that one kernel's
    duration does not show), over the whole profiled generate: the median and the sum of gaps under 50 us
    (longer ones are host waits between steps, counted apart)."""
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = json.loads(Path(f.name).read_text())["traceEvents"]
    ks = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") == "kernel")
    gaps = [b[0] - a[1] for a, b in zip(ks, ks[1:])]
    short = sorted(g for g in gaps if 0 <= g < 50)
    return {"kernels": len(ks), "short_gaps": len(short),
            "median_gap_us": short[len(short) // 2] if short else None,
            "short_gap_total_ms": sum(short) / 1e3, "long_gap_total_ms": sum(g for g in gaps if g >= 50) / 1e3,
            "kernel_total_ms": sum(b - a for a, b in ks) / 1e3}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--quantization", default=None, help="e.g. w4a16: the same weights quantized at load")
    ap.add_argument("--no-pdl", action="store_true",
                    help="launch without programmatic dependent launch (engine/kernels/pdl.py), so that each kernel's "
                         "time is its own and not its wait for the previous one")
    ap.add_argument("--out", default=".onecat/gpu_step_profile.json")
    args = ap.parse_args()
    from onecat.engine import SamplingParams
    from onecat.engine.kernels import pdl

    pdl.ENABLED = not args.no_pdl

    cfg = SHAPES[args.shape]
    with tempfile.TemporaryDirectory() as tmp:
        llm = build_onecat(make_model_dir(Path(tmp), cfg), cfg, max_model_len=args.ctx + 256, max_num_seqs=8,
                           cuda_graph=True, kv_cache_memory_gb=8.0, enable_prefix_caching=False,
                           **({"quantization": args.quantization} if args.quantization else {}))
    params = SamplingParams(temperature=0.0, max_tokens=args.steps + 1, ignore_eos=True)
    prompt = prompts(1, args.ctx, cfg["vocab_size"], 0)
    llm.generate(prompt, params)  # compile, capture

    def kernels_of(max_tokens: int):
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))[0]
            torch.cuda.synchronize()
        ks = [e for e in prof.key_averages() if e.device_type.name == "CUDA" and e.self_device_time_total > 0]
        return ks, sum(e.self_device_time_total for e in ks), out, prof

    prefill_kernels, prefill_us, _, _ = kernels_of(1)  # the same prompt's prefill alone, to subtract
    kernels, total_us, out, prof = kernels_of(args.steps + 1)
    prefill_by_name = {e.key: (e.count, e.self_device_time_total) for e in prefill_kernels}
    per_step = sorted(((e.key, (e.count - prefill_by_name.get(e.key, (0, 0))[0]) / args.steps,
                        (e.self_device_time_total - prefill_by_name.get(e.key, (0, 0))[1]) / 1e3 / args.steps)
                       for e in kernels), key=lambda r: -r[2])
    decode_s = out.timings.decode_s
    per_step_kernel_ms = (total_us - prefill_us) / 1e3 / args.steps
    top = sorted(kernels, key=lambda e: -e.self_device_time_total)[:25]
    rec = {"shape": args.shape, "quantization": args.quantization, "pdl": pdl.ENABLED, "ctx": args.ctx,
           "steps": args.steps, "kind": "measured",
           "gpu": torch.cuda.get_device_name(0), "step_ms_wall": 1e3 * decode_s / args.steps,
           "kernel_ms_per_step": per_step_kernel_ms,
           "gpu_busy_share": per_step_kernel_ms / (1e3 * decode_s / args.steps),
           "fused_kernels": llm.info()["fused_kernels"], "cuda_graph": llm.info()["cuda_graph"],
           "top_kernels": [{"name": e.key[:90], "calls": e.count, "total_ms": e.self_device_time_total / 1e3}
                           for e in top],
           "per_step_kernels": [{"name": k[:90], "calls_per_step": round(c, 2), "ms_per_step": round(ms, 4)}
                                for k, c, ms in per_step[:30]]}
    rec["kernel_gaps"] = kernel_gaps(prof)
    rec["host_top_functions"] = host_profile(llm, prompt, args.steps)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rec, indent=2))
    print(json.dumps(rec, indent=2))


if __name__ == "__main__":
    main()
