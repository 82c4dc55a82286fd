"""Time to first token on a GPU when every prompt length is new: what real traffic sees.

Two measurements on one model, neither pre-warming any prompt shape (the engine's own start-up
warm-up is part of the start-up time it reports):

- `sequential`: the in-process `LLM`, one request at a time, prompt lengths drawn log-uniformly from
  [--min-len, --max-len] and all distinct; TTFT from the engine's timings. Runs on any onecat
  version that has `LLM` (so an older checkout can be the peer in the same run).
- `serve`: `onecat serve` started as users start it (a separate process), then --requests streaming
  /v1/completions requests with Poisson arrivals at --rate req/s, distinct token-id prompts of the
  same length distribution; TTFT measured by the client. Start-up time = process start until
  /health answers (model load + warm-up).

Without --model it builds a random-init checkpoint with the embedded model's shape
(SmolLM2-135M: 30 layers, hidden 576, 9/3 heads, vocab 49152); latency depends on shapes, not values.

    python benchmarks/gpu_ttft.py sequential --out ttft_seq.json
    python benchmarks/gpu_ttft.py serve --requests 200 --rate 4 --out ttft_serve.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SMOLLM2_SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                     num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192)


def distinct_lengths(n: int, lo: int, hi: int, seed: int) -> list[int]:
    """n distinct prompt lengths, log-uniform in [lo, hi], in random order."""
    rng = random.Random(seed)
    seen: set[int] = set()
    while len(seen) < n:
        seen.add(int(round(math.exp(rng.uniform(math.log(lo), math.log(hi))))))
    out = sorted(seen)
    rng.shuffle(out)
    return out


def token_prompt(n: int, salt: int, vocab: int) -> list[int]:
    """A prompt of exactly n token ids that shares no prefix block with any other salt."""
    rng = random.Random(salt)
    return [rng.randrange(1, vocab - 1) for _ in range(n)]


def summary(ttfts_s: list[float], lengths: list[int]) -> dict:
    ms = sorted(t * 1e3 for t in ttfts_s)

    def pct(q: float) -> float:
        return ms[min(len(ms) - 1, max(0, math.ceil(q / 100 * len(ms)) - 1))]

    short = [t * 1e3 for t, n in zip(ttfts_s, lengths) if n <= 1024]
    return {"n": len(ms), "ttft_p50_ms": pct(50), "ttft_p90_ms": pct(90), "ttft_p99_ms": pct(99),
            "ttft_max_ms": ms[-1], "p99_over_p50": pct(99) / pct(50),
            "ttft_max_ms_prompts_le_1k": max(short) if short else None,
            "slowest": sorted(zip((round(t * 1e3, 1) for t in ttfts_s), lengths), reverse=True)[:5]}


def model_dir(arg: str | None) -> str:
    if arg:
        return arg
    sys.path.insert(0, str(ROOT))
    from tests.tiny_models import make_tiny_model

    return str(make_tiny_model("llama", Path(tempfile.mkdtemp()) / "smollm2-shape", **SMOLLM2_SHAPE))


def run_sequential(args) -> dict:
    import torch

    from onecat.engine import LLM, SamplingParams

    path = model_dir(args.model)
    t0 = time.perf_counter()
    llm = LLM(path, dtype="float16", device="cuda", cuda_graph=True, max_model_len=args.max_len + 64,
              max_num_batched_tokens=args.max_num_batched_tokens)
    start_s = time.perf_counter() - t0
    vocab = llm.model_config.vocab_size
    lengths = distinct_lengths(args.requests, args.min_len, args.max_len, args.seed)
    ttfts = []
    for i, n in enumerate(lengths):
        out = llm.generate([token_prompt(n, 1000 + i, vocab)],
                           SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True))[0]
        ttfts.append(out.timings.first_token_s)
    torch.cuda.synchronize()
    info = llm.info()
    return {"mode": "sequential", "max_num_batched_tokens": args.max_num_batched_tokens, "startup_s": start_s,
            "warmup": info.get("warmup"), **summary(ttfts, lengths),
            "device_name": info.get("device_name"), "attention_backend": info.get("attention_backend"),
            "lengths": lengths, "ttft_ms": [round(t * 1e3, 2) for t in ttfts]}


async def _poisson_load(url: str, lengths: list[int], rate: float, max_tokens: int, vocab: int, seed: int) -> list:
    import httpx

    from onecat.gates.engines.openai_client import stream_completion

    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600.0)) as client:
        async def one(i: int, n: int, delay: float):
            await asyncio.sleep(delay)
            body = {"model": "m", "prompt": token_prompt(n, 1000 + i, vocab), "max_tokens": max_tokens,
                    "temperature": 0.0, "ignore_eos": True}
            return await stream_completion(client, "/v1/completions", body, chat=False)

        at, tasks = 0.0, []
        for i, n in enumerate(lengths):
            tasks.append(one(i, n, at))
            at += rng.expovariate(rate)
        return await asyncio.gather(*tasks)


def run_serve(args) -> dict:
    from onecat.gates.engines.server_process import ServerProcess, free_port, onecat_serve_argv

    path = model_dir(args.model)
    port = free_port()
    flags = {"dtype": "float16", "device": "cuda", "cuda_graph": "full", "max_model_len": args.max_len + 64,
             "max_num_batched_tokens": args.max_num_batched_tokens}
    server = ServerProcess(onecat_serve_argv(path, port=port, served_model_name="m", flags=flags), port=port,
                           log_dir=tempfile.mkdtemp(), name="onecat-serve")
    t0 = time.perf_counter()
    server.start()
    try:
        start_s = time.perf_counter() - t0
        lengths = distinct_lengths(args.requests, args.min_len, args.max_len, args.seed)
        results = asyncio.run(_poisson_load(server.url, lengths, args.rate, args.max_tokens,
                                            SMOLLM2_SHAPE["vocab_size"], args.seed))
    finally:
        server.stop()
    failed = [r.error for r in results if r.error or r.ttft_s is None]
    ok = [(r.ttft_s, n) for r, n in zip(results, lengths) if not r.error and r.ttft_s is not None]
    return {"mode": "serve", "max_num_batched_tokens": args.max_num_batched_tokens, "startup_s": start_s,
            "rate_req_s": args.rate, "failed": len(failed),
            "first_errors": failed[:3], **summary([t for t, _ in ok], [n for _, n in ok]),
            "lengths": lengths}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=("sequential", "serve"))
    ap.add_argument("--model", help="HF directory or .gguf (default: random-init, the embedded model's shape)")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--min-len", type=int, default=16)
    ap.add_argument("--max-len", type=int, default=4096)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048,
                    help="engine token budget per step; prompts longer than it prefill in several steps")
    ap.add_argument("--rate", type=float, default=4.0, help="serve: Poisson arrivals per second")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--label", default="", help="stored with the figures (e.g. the revision under test)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    res = run_sequential(args) if args.mode == "sequential" else run_serve(args)
    res["label"] = args.label
    shown = {k: v for k, v in res.items() if k not in ("lengths", "ttft_ms")}
    print(json.dumps(shown, indent=1, default=str))
    if args.out:
        args.out.write_text(json.dumps(res, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()
