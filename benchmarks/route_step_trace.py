"""Per-step wall time of route 1 (contracts/seed_route_h200.yaml): after two untimed batches, each step of one
batch with its batch size, verify width, prompt tokens and tokens moved, the Triton kernel variants it built
(engine/kernels/triton_builds.py), and the totals by (batch, width); then the same batch once more, so a one-off
cost shows as the difference between the two. Where a batch's decode time goes, beside the gate's own averages.
    python benchmarks/route_step_trace.py [--arm baseline] [--gate on|off] --batch 8 --max-tokens 128 --out t.json
`--device cpu` runs the route's tiny shape (a logic check)."""
from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from seed_routes_gpu import ROUTES, engine_settings  # noqa: E402
from speculative_gpu_rounds import decode, prompts  # noqa: E402


def main() -> None:
    from onecat.engine import LLM
    from onecat.engine.kernels import triton_builds
    from onecat.gates.contract import load_contract

    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--arm", default="candidate")
    ap.add_argument("--gate", choices=("contract", "on", "off"), default="contract",
                    help="the speculative gate (disable_when_slower) as the contract sets it, or on / off")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    tiny = None if args.device == "cuda" else ROUTES["seed_route_h200"][0]
    contract = load_contract(Path(__file__).resolve().parent.parent / "contracts" / "seed_route_h200.yaml")
    kw = engine_settings(contract, args.arm, tiny, args.device, "peaked")
    if args.gate != "contract" and kw.get("speculative_config"):
        kw["speculative_config"] = {**kw["speculative_config"], "disable_when_slower": args.gate == "on"}
    with LLM(**kw) as llm:
        batch_prompts = prompts(args.batch, 1024, llm.model_config.vocab_size, seed=args.batch)
        for _ in range(2):
            decode(llm, batch_prompts, args.max_tokens)
        core, steps = llm.engine, []
        triton_builds.install()
        run, step = core._run, core.step

        def traced_run(scheduled):
            updates = run(scheduled)
            steps[-1].update(batch=len(scheduled), width=1 + max(s.num_lookahead for s in scheduled),
                             prefill=sum(s.num_new_tokens for s in scheduled if s.num_new_tokens > 1),
                             tokens=sum(len(u.new_tokens) for u in updates))
            return updates

        def traced_step():
            steps.append({})
            t, built = time.perf_counter(), triton_builds.mark()
            out = step()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            steps[-1]["ms"] = 1e3 * (time.perf_counter() - t)
            if triton_builds.mark() > built:  # kernel variants this step built (compiled or loaded from disk)
                steps[-1]["built"] = [b[:240] for b in triton_builds.since(built)]
            return out

        core._run, core.step = traced_run, traced_step
        tps, _ = decode(llm, batch_prompts, args.max_tokens)
        first = len(steps)
        again, _ = decode(llm, batch_prompts, args.max_tokens)  # the same batch once more: do the spikes recur?
        again_ms = sum(s["ms"] for s in steps[first:])
        steps, steps_again = steps[:first], steps[first:]
        by = collections.defaultdict(lambda: [0, 0.0, 0])
        for s in steps:
            key = "prefill" if s.get("prefill") else f"b{s.get('batch')} w{s.get('width')}"
            by[key][0] += 1
            by[key][1] += s["ms"]
            by[key][2] += s.get("tokens", 0)
        summary = {k: {"steps": n, "ms": round(ms, 1), "ms_per_step": round(ms / n, 2), "tokens": t}
                   for k, (n, ms, t) in sorted(by.items())}
        gate = (llm.info().get("speculative") or {}).get("gate")
        record = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "arm": args.arm,
                  "tok_s": round(tps, 2), "total_ms": round(sum(s["ms"] for s in steps), 1), "by": summary,
                  "again_tok_s": round(again, 2), "again_total_ms": round(again_ms, 1), "steps_again": steps_again,
                  "gate": gate, "steps": steps}
        args.out.write_text(json.dumps(record, indent=1))
        print(f"{args.arm}: {tps:.1f} tok/s, {len(steps)} steps, {record['total_ms']} ms; again {again:.1f} tok/s, "
              f"{again_ms:.1f} ms")
        for label, run in (("first", steps), ("again", steps_again)):
            for i, s in enumerate(run):
                if s.get("built") or s["ms"] > 200:
                    print(f"  {label} step {i}: {s['ms']:.1f} ms, batch {s.get('batch')}, width {s.get('width')}, "
                          f"prefill {s.get('prefill')}; built {len(s.get('built', []))}:")
                    for b in s.get("built", [])[:6]:
                        print(f"    {b[:200]}")
        for k, v in summary.items():
            print(f"  {k}: {v}")


if __name__ == "__main__":
    main()
