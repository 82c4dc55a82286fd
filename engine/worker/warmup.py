"""Start-up warm-up on CUDA: compile every kernel variant and capture every decode graph before the
first request, so no request pays for them.

A GPU engine compiles Triton kernels on their first launch and captures a CUDA graph on the first
decode step of each batch size. Left to the request path, that cost a first request seconds and
many later ones hundreds of milliseconds (measured on an H200: first request 5 s, then 0.3-1.5 s
for prompt lengths not seen before). The warm-up runs, through the normal engine path, the request
shapes that select a different compiled variant: a short prompt (the paged kernel on per-token
rows), a long prompt (the prefill attention), a prompt chunk after a computed prefix (masked
attention; once from a prefix-cache hit, once from a prompt longer than one step's token budget),
greedy and sampled decoding, a batch of two; then it captures the graph of every batch size, largest
first so the smaller ones reuse its memory pool, and (a hybrid model with speculation) builds the Gated
DeltaNet rows kernel at each padded width an eager verify chunk can take. Kernels whose row count changes
from step to step do not specialize on it (engine/kernels/triton_builds.py says why); the variants built
after the warm-up are counted in `LLM.info()["kernel_variants_built_after_warmup"]`.
What it cost is logged and reported in `LLM.info()["warmup"]`. Compiled Triton kernels also go to
Triton's on-disk cache ($TRITON_CACHE_DIR, default ~/.triton/cache), so a restart loads them instead
of compiling again. Counters it moved (steps, tokens, prefix-cache lookups, attention calls) are
reset afterwards; nothing it cached stays visible to requests.
"""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch

from onecat.engine.sampling_params import SamplingParams
from onecat.engine.worker.model_runner import ModelRunner

log = logging.getLogger("onecat.engine")

SHORT_PROMPT = 8  # decoded like a speculative verify chunk: the paged kernel on per-token rows
LONG_PROMPT = 48  # a prefill chunk: the prefill attention path
VERIFY_WARM_SIZES = 32  # verify graphs ((1 + k) tokens per row) captured at start-up up to this batch


def triton_cache_dir() -> str:
    return os.environ.get("TRITON_CACHE_DIR") or str(Path.home() / ".triton" / "cache")


def build_verify_row_kernels(runner: ModelRunner, dtype: torch.dtype) -> int:
    """A hybrid model's eager verify chunks (those sharing a step with prompt chunks) run the Gated DeltaNet rows
    kernel at their own width, padded to a power of two: one build per padded width up to 1 + k, done here on a
    dummy row (every such layer has the same shapes, so one layer's launches build them all)."""
    from onecat.engine.layers.gated_deltanet import GatedDeltaNet

    q = runner.verify_query_len
    layer = next((m for m in runner.model.modules() if isinstance(m, GatedDeltaNet)), None)
    if q < 2 or layer is None:
        return 0
    return layer.build_verify_row_kernels(list(range(2, q + 1)), dtype, runner.device)


def warm_up(runner: ModelRunner, vocab: int, max_model_len: int, token_budget: int,
            generate: Callable[[list[list[int]], list[SamplingParams]], object],
            reset_counters: Callable[[], None], dtype: torch.dtype) -> dict:
    """Warm up a CUDA engine whose steps `runner` runs (`token_budget`: max_num_batched_tokens; `dtype`: its
    activations'). Requests go through `generate` (token ids, params: the normal engine path,
    LLM.engine_generate), then `reset_counters` (the engine core's) clears what they moved. Returns what it did,
    for info()."""
    t0 = time.perf_counter()
    limit = max_model_len - 4  # room for the prompt plus the tokens decoded

    def prompt(n: int, salt: int) -> list[int]:
        return [(salt * 7919 + i * 31) % (vocab - 1) + 1 for i in range(max(1, min(n, limit)))]

    greedy = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    sampled = SamplingParams(temperature=1.0, top_p=0.9, seed=0, max_tokens=3, ignore_eos=True)
    generate([prompt(SHORT_PROMPT, 1)], [greedy])
    long = prompt(LONG_PROMPT, 2)
    generate([long, prompt(SHORT_PROMPT, 3)], [greedy, sampled])
    # a prefill chunk after a computed prefix (masked attention): from a prefix-cache hit, and from a prompt
    # longer than one step's token budget (chunked prefill)
    generate([long + prompt(LONG_PROMPT, 4)], [greedy])
    generate([prompt(token_budget + LONG_PROMPT, 5)], [greedy])
    graphs = runner.graphs
    captured = []
    if graphs is not None and graphs.disabled_reason is None:
        for size in sorted(graphs.sizes, reverse=True):
            if runner.ensure_graph(size):
                captured.append(size)
        q = graphs.verify_query_len
        if q and q > 1 and graphs.verify_disabled_reason is None:  # speculative verify steps replay too, at
            for size in sorted(s for s in graphs.sizes if s <= VERIFY_WARM_SIZES):  # larger ones on first use
                for width in graphs.verify_widths(size):  # every width
                    runner.ensure_graph(size, width)
    verify_rows = build_verify_row_kernels(runner, dtype)
    reset_counters()
    seconds = round(time.perf_counter() - t0, 3)
    result = {"seconds": seconds, "graph_sizes": sorted(captured), "triton_cache_dir": triton_cache_dir()}
    if verify_rows:
        result["verify_row_widths_built"] = verify_rows
    log.info("warm-up: %.2f s (kernels compiled, %d decode graphs captured)", seconds, len(captured))
    return result
