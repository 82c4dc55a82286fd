"""determinism: the same requests give the same tokens across reruns and across batch sizes.

For each seed, the prompts run `reruns` times as one batch, and (batch_invariance) once each alone.
All runs of a prompt share a group ("seed=S/p=I"): token_hash_equal with compare: within_arm checks
that each group has one token hash; compare: arms pairs the same request keys between arms.
Sampled decoding is reproducible through per-request seeds (seed + prompt index). Every generation
is free to stop, so these rows also feed natural_stop_rate.
"""
from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field

from onecat.gates.contract import SamplingSpec, WorkloadBase
from onecat.gates.engines.base import Engine
from onecat.gates.registry import register_runner
from onecat.gates.runners.base import Runner, Sink, Unit, request_record, to_sampling_params

DEFAULT_PROMPTS = (  # short-answer questions, so small models stop on their own well under the cap
    "What is 12 plus 30? Reply with the number only.",
    "Which planet is known as the Red Planet? Answer in a few words.",
    "How many days are in a week? Reply with the number only.",
    "What is the capital of France? Answer in one word.",
    "Give one synonym for 'happy'. Reply with one word.",
    "Translate 'thank you' into Spanish. Reply with the translation only.",
    "Name three primary colors.",
    "Write one short sentence about the sea.",
)


@register_runner("determinism")
class Determinism(Runner):
    deterministic_when = "greedy"  # --reuse-baseline may copy its rows (Runner.deterministic_evidence)
    class Workload(WorkloadBase):
        kind: Literal["determinism"] = "determinism"
        prompts: Optional[list[str]] = None  # chat user messages; default: short built-in questions
        num_prompts: int = Field(default=4, ge=1)
        reruns: int = Field(default=2, ge=1)
        batch_invariance: bool = True
        max_tokens: Optional[int] = Field(default=None, ge=1)  # default: sampling.max_tokens
        seeds: Optional[list[int]] = None  # default: the contract's seeds
        # record the N likeliest tokens' logprobs at every generated token (token_hash_equal's near_tie needs 2)
        top_logprobs: int = Field(default=0, ge=0, le=20)

    def _prompts(self, w: Workload) -> list[str]:
        pool = list(w.prompts or DEFAULT_PROMPTS)
        return [pool[i % len(pool)] for i in range(w.num_prompts)]

    def plan(self, workload: Workload, sampling: SamplingSpec, seeds: list[int]) -> list[Unit]:
        units = []
        for s in workload.seeds or seeds:
            units += [Unit(key=f"seed={s}/pass={j}", seed=s, repeat=j, size=workload.num_prompts,
                           params=(("mode", "batch"),)) for j in range(workload.reruns)]
            if workload.batch_invariance:
                units += [Unit(key=f"seed={s}/solo/p={i}", seed=s, size=1, params=(("mode", "solo"), ("index", i)))
                          for i in range(workload.num_prompts)]
        return units

    def run_unit(self, engine: Engine, workload: Workload, sampling: SamplingSpec, unit: Unit, sink: Sink) -> None:
        prompts = self._prompts(workload)
        p = dict(unit.params)
        idx = list(range(len(prompts))) if p["mode"] == "batch" else [p["index"]]
        max_tokens = workload.max_tokens or sampling.max_tokens
        extra = {"logprobs": workload.top_logprobs} if workload.top_logprobs else {}
        params = [to_sampling_params(sampling, seed=unit.seed + i, max_tokens=max_tokens, **extra) for i in idx]
        outs = engine.chat([[{"role": "user", "content": prompts[i]}] for i in idx], params)
        for i, out in zip(idx, outs):
            key = f"{unit.key}/p={i}" if p["mode"] == "batch" else unit.key
            sink.request(request_record(key, out, engine.tokenizer, prompt=prompts[i], seed=unit.seed,
                                        repeat=unit.repeat, batch_size=len(idx),
                                        determinism_group=f"seed={unit.seed}/p={i}"))
        sink.advance(len(idx))
