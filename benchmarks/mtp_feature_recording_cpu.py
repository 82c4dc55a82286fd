"""Host time the MTP proposer spends on feature recording (record_features and, where the tree has it, the batched
_flush_features) while the tiny Qwen3.5 (tests/data/tiny-qwen35, which carries an MTP head) decodes on the CPU.
A proxy for the host work a GPU step waits for: the decode step there is one graph replay, the recording is not.

    python benchmarks/mtp_feature_recording_cpu.py --batch 8                   # this tree
    PYTHONPATH=DIR python benchmarks/mtp_feature_recording_cpu.py --batch 8   # DIR/onecat -> another checkout

Prints one JSON line: the recording's seconds and calls over one timed generate, and its microseconds per token
and request. Run the trees interleaved, on a quiet machine, and name the CPU with the figures.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from onecat.engine import LLM, SamplingParams
from onecat.engine.speculative import mtp

MODEL = Path(__file__).resolve().parent.parent / "tests" / "data" / "tiny-qwen35"


def timed(name: str, spent: dict) -> None:
    """Wrap MTPProposer.`name` (if this tree has it) to add its wall time to `spent`."""
    f = getattr(mtp.MTPProposer, name, None)
    if f is None:
        return

    def wrapped(*a, **kw):
        start = time.perf_counter()
        try:
            return f(*a, **kw)
        finally:
            spent["seconds"] += time.perf_counter() - start
            spent["calls"] += 1

    setattr(mtp.MTPProposer, name, wrapped)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    spec = {"method": "mtp", "num_speculative_tokens": 3, "disable_when_slower": False}
    prompts = [[(7 * i + 3 * j) % 200 + 1 for j in range(12)] for i in range(args.batch)]
    spent = {"seconds": 0.0, "calls": 0}
    with LLM(str(MODEL), speculative_config=spec, max_model_len=256, max_num_seqs=args.batch, device="cpu") as llm:
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))  # warm-up
        timed("record_features", spent)
        timed("_flush_features", spent)
        start = time.perf_counter()
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True))
        wall = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outs)
    print(json.dumps({"tree": str(Path(mtp.__file__).resolve().parents[2]), "batch": args.batch,
                      "recording_s": round(spent["seconds"], 5), "calls": spent["calls"], "generate_s": round(wall, 4),
                      "recording_us_per_token_per_request": round(1e6 * spent["seconds"] / tokens, 1)}))


if __name__ == "__main__":
    main()
