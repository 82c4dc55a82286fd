"""Sampled decode steps' sampling, replayed from a CUDA graph.

A sampled batch's draws are ~55 small kernels (temperature, the top-k candidates, the nucleus, the keyed
Gumbel-max noise; ~120 when the H100 figure below was taken); launched one by one they cost ~1 ms of host time a
step, which on a small model is several
times the step itself (the embedded target on an H100: 567 sampled against 2346 greedy tok/s). For a steady
batch those kernels are the same every step: the logits come from the decode graph's output buffer, the row
settings are constants (sampler.constant), and only the (seed, position) keys change. So the sampling of a
batch is captured once per (logits buffer, row settings) and replayed with new keys.

On a GPU the sampling makes no host decision from the logits (sampler.filtered sorts a top-p row without top-k
whole there), so every batch's draws can be captured. A batch's settings are captured the second time they are
seen, so batches whose settings change every step (requests coming and going) do not pay captures they never
replay.
"""
from __future__ import annotations

from collections import OrderedDict

import torch

from onecat.engine.core.sampler import sample_on_device
from onecat.engine.sampling_params import SamplingParams
from onecat.engine.switches import switch

# on by default (H100: sampled decode at batch 1 673 -> 1,430 tok/s, the same tokens,
# benchmarks/results/gpu_sampled_decode_h100.json); ONECAT_SAMPLER_GRAPHS=0 launches each draw's kernels eagerly
SAMPLER_GRAPHS = switch("ONECAT_SAMPLER_GRAPHS", True)
MAX_GRAPHS = 8  # distinct (buffer, settings) kept; the least recently used is dropped past this
MAX_SEEN = 256  # distinct (buffer, settings) remembered as met once


def draw_settings(p: SamplingParams) -> tuple:
    """What a captured draw fixes of a row's settings (its graph key; the keys themselves change every step)."""
    return (p.greedy, p.temperature, p.top_k, p.top_p, p.min_p)


class SamplerGraphs:
    def __init__(self):
        self.graphs: OrderedDict[tuple, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = OrderedDict()
        self.seen: OrderedDict[tuple, None] = OrderedDict()  # settings met once, the newest MAX_SEEN of them
        self.captures = self.replays = 0
        self.disabled_reason: str | None = None  # a capture failed: every draw runs eagerly from then on
        # one memory pool for all of them (a pool each would hold every graph's intermediates): a later capture
        # may place its tokens where an earlier graph keeps intermediates, so a replay's tokens must be used
        # (queued copies) before the next replay, as the decode pipeline does
        self.pool = None

    def sample(self, logits: torch.Tensor, params: list[SamplingParams], keys: torch.Tensor) -> torch.Tensor:
        """sample_on_device(logits, params, keys), from a graph where one is captured or worth capturing.
        `logits` must be a buffer whose storage the caller keeps (a decode graph's output). Logits off a CUDA device
        draw eagerly (a capture would record none of their work)."""
        if self.disabled_reason is not None or not logits.is_cuda:
            return sample_on_device(logits, params, keys)
        key = (logits.data_ptr(), tuple(logits.shape), logits.dtype, tuple(draw_settings(p) for p in params))
        entry = self.graphs.get(key)
        if entry is None:
            if key not in self.seen:
                self.seen[key] = None
                self.seen.move_to_end(key)
                if len(self.seen) > MAX_SEEN:  # batches whose settings keep changing must not grow it forever
                    self.seen.popitem(last=False)
                return sample_on_device(logits, params, keys)
            try:
                entry = self._capture(key, logits, params, keys)
            except Exception as e:  # a capture failure turns the sampling graphs off, not the step
                self.disabled_reason = f"capture failed: {type(e).__name__}: {e}".split("\n")[0]
                self.graphs.clear()
                torch.cuda.synchronize(logits.device)
                return sample_on_device(logits, params, keys)
        self.graphs.move_to_end(key)
        graph, static_keys, out = entry
        static_keys.copy_(keys)
        graph.replay()
        self.replays += 1
        return out

    def _capture(self, key: tuple, logits: torch.Tensor, params: list[SamplingParams], keys: torch.Tensor):
        static_keys = keys.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # the warm-up makes every constant and library workspace first
            sample_on_device(logits, params, static_keys)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=self.pool):
            out = sample_on_device(logits, params, static_keys)
        self.graphs[key] = entry = (graph, static_keys, out)
        self.captures += 1
        if len(self.graphs) > MAX_GRAPHS:
            self.graphs.popitem(last=False)
        return entry

    def describe(self) -> dict:
        return {"captured": self.captures, "replays": self.replays, "kept": len(self.graphs),
                **({"disabled_reason": self.disabled_reason} if self.disabled_reason else {})}
