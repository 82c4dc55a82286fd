"""Where a speculative round makes the host wait for the GPU: every synchronizing CUDA call (a device-to-host read,
a copy from pageable host memory, a stream or device synchronize) made while an engine decodes, counted by the
engine code that made it, per engine step. A round should make at most one (the read of its accepted tokens);
each other one stops the host from preparing the next round while the GPU runs this one.

Counted with torch.cuda.set_sync_debug_mode("warn"), which warns on each such call; the warning's Python stack
names the engine lines. Random weights (`random:NAME`, load_format dummy), CUDA graphs full, after two untimed
runs (graph captures, the synthetic proposer learning the continuation). Arms: target-only decoding, n-gram,
synthetic speculation with a DFlash drafter's compute (dense and hybrid shapes) and MTP (the tiny Qwen3.5 test
checkpoint with its head), each at batch 1 and 8.

    python benchmarks/gpu_round_syncs.py [--arms plain,ngram,dflash,hybrid,mtp] [--out FILE]

A logic check runs on the CPU (--device cpu: nothing is counted there, no CUDA).
"""
from __future__ import annotations

import argparse
import collections
import json
import traceback
import warnings
from datetime import datetime, timezone
from pathlib import Path

from onecat.engine import LLM, SamplingParams

ROOT = Path(__file__).resolve().parents[1]
SYNTHETIC = {"method": "synthetic", "compute": "dflash", "disable_when_slower": False}
ARMS = {  # name: (model, speculative_config or None)
    "plain": ("random:smollm2-135m", None),
    "ngram": ("random:smollm2-135m", {"method": "ngram", "num_speculative_tokens": 3}),
    "dflash": ("random:smollm2-135m", dict(SYNTHETIC, num_speculative_tokens=7, acceptance_length=3.0)),
    "hybrid": ("random:tiny-qwen3.5", dict(SYNTHETIC, num_speculative_tokens=15, acceptance_length=4.27)),
    "mtp": (str(ROOT / "tests" / "data" / "tiny-qwen35"), {"method": "mtp", "num_speculative_tokens": 3,
                                                          "disable_when_slower": False}),
}


def _site(stack: list[traceback.FrameSummary]) -> str:
    """The innermost engine frames of a stack (outside torch and the standard library), as file:line <- ..."""
    own = [f for f in stack if str(ROOT) in f.filename and "benchmarks" not in f.filename]
    return " <- ".join(f"{Path(f.filename).relative_to(ROOT)}:{f.lineno}" for f in own[-3:][::-1]) or "outside"


def counted(run, cuda: bool) -> tuple[object, collections.Counter]:
    """run()'s result and its synchronizing calls by engine site (none counted off CUDA)."""
    sites: collections.Counter = collections.Counter()
    if not cuda:
        return run(), sites
    import torch

    def note(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" in str(message):
            sites[_site(traceback.extract_stack()[:-1])] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = note
        torch.cuda.set_sync_debug_mode("warn")
        try:
            result = run()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return result, sites


def arm(name: str, batch: int, max_tokens: int, device: str) -> dict:
    model, spec = ARMS[name]
    cuda = device.startswith("cuda")
    kw = dict(device=device, cuda_graph="full" if cuda else "off", max_model_len=64 + max_tokens + 32,
              max_num_seqs=8, enable_prefix_caching=False)
    if model.startswith("random:"):
        kw.update(load_format="dummy", dtype="float16" if cuda else "float32")
    if spec is not None:
        kw["speculative_config"] = spec
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    with LLM(model, **kw) as llm:
        vocab = llm.model_config.vocab_size
        prompts = [[(7 * i + 13 * j) % (vocab - 1) + 1 for j in range(48)] for i in range(batch)]
        for _ in range(2):  # graph captures; the synthetic proposer learns the continuation
            llm.generate(prompts, params)
        outs, sites = counted(lambda: llm.generate(prompts, params), cuda)
        report = llm.cuda_graph_report()
    rounds = sum(o.spec.num_drafts for o in outs if o.spec is not None)
    accepted = sum(o.spec.num_accepted_tokens for o in outs if o.spec is not None)
    tokens = sum(len(o.token_ids) for o in outs)
    total = sum(sites.values())
    steps = (tokens - accepted) // batch  # a request's steps: one per token, less its accepted drafts
    return {"model": model, "speculative": spec, "batch": batch, "tokens": tokens, "rounds": rounds,
            "accepted": accepted, "engine_steps_about": steps, "syncs": total,
            "syncs_per_step": round(total / max(steps, 1), 3), "by_site": dict(sites.most_common()),
            "graph_replays": report.get("replays"), "verify_replays": report.get("verify_replays")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/gpu_round_syncs.json"))
    args = ap.parse_args()
    import torch

    names = args.arms.split(",")
    if not set(names) <= set(ARMS):
        raise SystemExit(f"--arms {args.arms}: expected some of {', '.join(ARMS)}")
    record = {"benchmark": "gpu_round_syncs", "kind": "measured" if args.device.startswith("cuda") else "logic check",
              "device": torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "cpu",
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "arms": []}
    for name in names:
        for batch in [int(b) for b in args.batch_sizes.split(",")]:
            row = dict(arm(name, batch, args.max_tokens, args.device), arm=name)
            record["arms"].append(row)
            top = ", ".join(f"{n} x {s}" for s, n in list(row["by_site"].items())[:3])
            print(f"{name} batch {batch}: {row['syncs']} synchronizing calls over ~{row['engine_steps_about']} steps "
                  f"({row['rounds']} rounds): {top}", flush=True)
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(record, indent=1))  # written after each arm: a cut run keeps its rows


if __name__ == "__main__":
    main()
