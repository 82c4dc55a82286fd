"""Shared machinery of the throughput runners: distinct synthetic prompts, warm-up, A/B/A units."""
from __future__ import annotations

import time
from typing import Literal, Optional

import numpy as np
from pydantic import Field, field_validator

from onecat.gates.contract import SamplingSpec, WorkloadBase
from onecat.gates.engines.base import Engine
from onecat.gates.runners.base import Metric, Runner, Sink, Unit, request_record, to_sampling_params
from onecat.results.records import is_failed_request

TOKEN_ID_FLOOR = 256  # skip byte / special tokens at the bottom of most vocabularies


class ThroughputWorkload(WorkloadBase):
    input_len: int = Field(ge=1)
    output_len: int = Field(ge=1)
    batch_sizes: list[int] = Field(min_length=1)
    repeats: int = Field(default=3, ge=1)
    warmup: int = Field(default=1, ge=0)  # un-timed batches per (arm, batch size) before measuring
    # "random": distinct random tokens; "repeat": a random span followed by its own beginning again, a
    # synthetic repeated-context prompt (like code editing) whose continuation copies earlier tokens
    prompt_style: Literal["random", "repeat"] = "random"
    # "fresh": warm-up batches of other prompts, 2 tokens each (kernels and allocator); "timed": the timed
    # batch itself, in full, before it is timed (what a run learns from its prompts, e.g. speculative
    # method synthetic's greedy continuations, is then in place; the prefix cache may hold them too)
    warmup_prompts: Literal["fresh", "timed"] = "fresh"

    @field_validator("batch_sizes")
    @classmethod
    def _positive(cls, v: list[int]) -> list[int]:
        if any(b < 1 for b in v) or len(set(v)) != len(v):
            raise ValueError(f"batch_sizes must be distinct positive integers, got {v}")
        return v


def synthetic_prompts(engine: Engine, n: int, length: int, seed: int, style: str = "random") -> list[list[int]]:
    """n distinct random token-id prompts (distinct so the prefix cache cannot serve them)."""
    hi = engine.vocab_size or 32000
    hi = max(TOKEN_ID_FLOOR + 1000, min(hi, 1 << 20))
    rng = np.random.default_rng(seed)
    if style == "repeat":
        span = max(1, (length + 1) // 2)
        out = []
        for _ in range(n):
            part = rng.integers(TOKEN_ID_FLOOR, hi - 1, size=span).tolist()
            out.append((part + part)[:length])
        return out
    return [rng.integers(TOKEN_ID_FLOOR, hi - 1, size=length).tolist() for _ in range(n)]


class ThroughputRunner(Runner):
    """Units: one per (batch size, repeat), interleaved across arms; the baseline runs one extra repeat."""

    measure_decode = True
    speculative = False  # set per unit from the engine's effective settings

    def __init__(self) -> None:
        self._warm: set = set()

    def plan(self, workload: ThroughputWorkload, sampling: SamplingSpec, seeds: list[int]) -> list[Unit]:
        return [Unit(key=f"bs={bs}/rep={r}", seed=seeds[0], repeat=r, interleave=True, size=1, series=f"bs={bs}",
                     params=(("batch_size", bs),))
                for bs in workload.batch_sizes for r in range(workload.repeats)]

    def output_len(self, workload: ThroughputWorkload) -> int:
        return workload.output_len

    def min_request_tokens(self, workload: ThroughputWorkload, sampling: SamplingSpec) -> int:
        return workload.input_len + self.output_len(workload)

    def _params(self, workload: ThroughputWorkload, sampling: SamplingSpec, seed: Optional[int]):
        return to_sampling_params(sampling, seed=seed, max_tokens=self.output_len(workload), ignore_eos=True,
                                  stop=None)

    def run_unit(self, engine: Engine, workload: ThroughputWorkload, sampling: SamplingSpec, unit: Unit,
                 sink: Sink) -> None:
        bs = dict(unit.params)["batch_size"]
        warm_key = (id(engine), workload.id, bs)
        # same prompts for both arms and every repeat of a batch size (fresh ids per batch size)
        prompts = synthetic_prompts(engine, bs, workload.input_len, seed=1000 * bs + (unit.seed or 0),
                                    style=workload.prompt_style)
        params = [self._params(workload, sampling, None if unit.seed is None else unit.seed + i) for i in range(bs)]
        if warm_key not in self._warm:
            if workload.warmup_prompts == "timed":
                for _ in range(workload.warmup):
                    engine.generate(prompts, params)
            else:
                warm = to_sampling_params(sampling, seed=unit.seed, max_tokens=min(2, self.output_len(workload)),
                                          ignore_eos=True, stop=None)
                for w in range(workload.warmup):  # full prompt shapes, few tokens: warms kernels and allocator
                    engine.generate(synthetic_prompts(engine, bs, workload.input_len, 10_000 + w), [warm] * bs)
            self._warm.add(warm_key)
        t0 = time.perf_counter()
        outs = engine.generate(prompts, params)
        wall = time.perf_counter() - t0
        for i, out in enumerate(outs):
            sink.request(request_record(f"{unit.key}/req={i}", out, engine.tokenizer, prompt=prompts[i],
                                        natural_stop_eligible=False, seed=unit.seed, repeat=unit.repeat,
                                        batch_size=bs, determinism_group=f"bs={bs}/req={i}"))
        self.speculative = bool((engine.info() or {}).get("speculative"))
        if any(is_failed_request(o) for o in outs):
            sink.advance(1)  # a batch with a failed request times nothing real: its rows say why, no figure
            return
        self.emit_metrics(outs, wall, bs, unit, sink)

    def emit_metrics(self, outs: list, wall: float, bs: int, unit: Unit, sink: Sink) -> None:
        key, rep = f"bs={bs}", unit.repeat
        n_in = sum(len(o.prompt_token_ids) for o in outs)
        n_out = sum(len(o.token_ids) for o in outs)
        ttft = [o.timings.first_token_s for o in outs]
        first_done = min(o.timings.first_token_s for o in outs)
        last_done = max(o.timings.e2e_s for o in outs)
        decoded = sum(max(len(o.token_ids) - 1, 0) for o in outs)
        tpots = [o.timings.decode_s / (len(o.token_ids) - 1) for o in outs if len(o.token_ids) > 1]

        def m(name: str, value: float, unit_name: str) -> None:
            sink.metric(Metric(name=name, value=value, unit=unit_name, key=key, repeat=rep, seed=unit.seed))

        m("wall_s", wall, "s")
        m("prefill_tok_s", n_in / max(max(ttft), 1e-9), "tok/s")
        m("ttft_mean_s", float(np.mean(ttft)), "s")
        m("output_tok_s", n_out / max(wall, 1e-9), "tok/s")
        drafts = sum(o.spec.num_drafts for o in outs)
        if self.measure_decode and decoded:
            # speculative and target-only decode rates are different metrics, never one as the other
            speculative = drafts > 0 or self.speculative
            m("spec_decode_tok_s" if speculative else "decode_tok_s", decoded / max(last_done - first_done, 1e-9),
              "tok/s")
            m("tpot_mean_s", float(np.mean(tpots)), "s")
        if drafts:
            accepted = sum(o.spec.num_accepted_tokens for o in outs)
            m("acceptance_length", 1.0 + accepted / drafts, "tokens/round")
        sink.advance(1)
