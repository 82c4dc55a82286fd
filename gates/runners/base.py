"""The runner interface: how a workload kind turns an engine into stored rows.

Adding a workload kind is one file in gates/runners/ and one decorator line:

    from typing import Literal
    from onecat.gates.registry import register_runner
    from onecat.gates.runners.base import Runner, TaskWorkload, request_record

    @register_runner("my_kind")
    class MyRunner(Runner):
        class Workload(TaskWorkload):            # pydantic; extra keys are refused
            kind: Literal["my_kind"] = "my_kind"
            limit: int = 10

        def run(self, engine, workload, sampling, seeds, sink):
            data = sink.dataset(workload.dataset)  # ResolvedDataset, resolved before any engine opened
            for seed in seeds:
                for item in load_items(data.path)[: workload.limit]:
                    key = f"{item.id}/seed={seed}"
                    if sink.is_done(key):          # --resume: finished requests are not redone
                        continue
                    out = engine.chat([[{"role": "user", "content": item.prompt}]],
                                      to_sampling_params(sampling, seed=seed))[0]
                    sink.request(request_record(key, out, engine.tokenizer, seed=seed))
                    sink.item(ItemOutcome(item_id=item.id, seed=seed, passed={"correct": ok},
                                          extracted_answer=ans, failure_reason=why), request_key=key)

`run(engine, workload, sampling, seeds, sink)`:
    engine   -- an open engine (gates/engines/base.py `Engine`): generate / chat / score / tokenizer / info
    workload -- the validated `Workload` instance from the contract
    sampling -- the contract's SamplingSpec (use to_sampling_params to build engine params)
    seeds    -- the contract's predeclared seeds
    sink     -- Sink below (results/sink.py RunSink): rows written through it are committed at once

Runners whose work should be interleaved across arms (throughput repeats, A/B/A) override
`plan()` and `run_unit()` instead; the orchestrator then alternates units between the arms.
The row types (RequestRecord, ItemOutcome, Metric) are the results store's (results/records.py),
importable from here too. Per-item task outcomes (ItemOutcome) go to the `item_outcomes` table
that the `task_score` check reads: one row per (item, seed, measure), where `passed` maps
measure -> bool, e.g. {"base": True, "plus": False} for EvalPlus or {"correct": True} for GSM8K.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, ClassVar, Optional, Protocol

from pydantic import BaseModel, ConfigDict, Field

from onecat.engine.sampling_params import SamplingParams
from onecat.gates.contract import SAMPLING_IN_CONTRACT, SamplingSpec, WorkloadBase
from onecat.gates.engines.base import Engine
from onecat.gates.health import generation_health
from onecat.gates.registry import declare_workload_schema
from onecat.results.records import ItemOutcome, Metric, RequestRecord  # noqa: F401 - the runner-author API


# --------------------------------------------------------------------------- rows
class Sink(Protocol):
    """Where runners put rows; every call commits before it returns."""

    arm: str
    workload_id: str

    def dataset(self, name: str) -> Any: ...  # ResolvedDataset (path, sha256, origin)
    def is_done(self, request_key: str) -> bool: ...
    def request(self, record: RequestRecord) -> None: ...
    def item(self, outcome: ItemOutcome, request_key: Optional[str] = None) -> None: ...
    def metric(self, metric: Metric) -> None: ...
    def advance(self, n: int = 1) -> None: ...  # progress bar


# --------------------------------------------------------------------------- units and runners
@dataclass(frozen=True)
class Unit:
    """A resumable slice of a workload. Finished units are skipped on --resume.

    interleave=True units are alternated between arms (A/B/A...), with the baseline running one
    extra repeat (a copy of the series' last unit with repeat + 1, key "<series>/rep=<n>") at the end,
    so every candidate repeat is bracketed by two baseline repeats.
    """

    key: str
    seed: Optional[int] = None
    repeat: Optional[int] = None
    interleave: bool = False
    series: Optional[str] = None  # interleaved units of one series differ only in `repeat`
    size: int = 1  # progress-bar steps
    params: tuple = ()  # hashable (name, value) pairs for the runner


class Runner:
    """Base class. Override `run` (simple) or `plan` + `run_unit` (resumable / interleaved units)."""

    kind: ClassVar[str]
    Workload: ClassVar[type[WorkloadBase]]
    # When a workload's stored rows are a pure function of the arm's settings, its datasets and the
    # environment class, so --reuse-baseline may copy them from an earlier run (gates/baseline_reuse.py):
    # "never" (speed figures: always measured fresh), "greedy" (generations under temperature 0) or "always"
    # (no sampling at all, e.g. scoring).
    deterministic_when: ClassVar[str] = "never"

    def plan(self, workload: WorkloadBase, sampling: SamplingSpec, seeds: list[int]) -> list[Unit]:
        return [Unit(key="all", size=1, params=(("seeds", tuple(seeds)),))]

    def run_unit(self, engine: Engine, workload: WorkloadBase, sampling: SamplingSpec, unit: Unit, sink: Sink) -> None:
        self.run(engine, workload, sampling, list(dict(unit.params)["seeds"]), sink)

    def run(self, engine: Engine, workload: WorkloadBase, sampling: SamplingSpec, seeds: list[int], sink: Sink) -> None:
        for unit in self.plan(workload, sampling, seeds):
            self.run_unit(engine, workload, sampling, unit, sink)

    def deterministic_evidence(self, workload: WorkloadBase, sampling: SamplingSpec) -> bool:
        """Whether this workload's rows may be reused from an earlier run of an identical arm (see
        `deterministic_when`); the one place that decides it per runner."""
        if self.deterministic_when not in ("never", "greedy", "always"):
            raise ValueError(f"{type(self).__name__}.deterministic_when = {self.deterministic_when!r}; "
                             "use never, greedy or always")
        return self.deterministic_when == "always" or (self.deterministic_when == "greedy"
                                                       and sampling.temperature == 0)

    def min_request_tokens(self, workload: WorkloadBase, sampling: SamplingSpec) -> int:
        """The fewest tokens (prompt + requested output) that one request of this workload needs, from the
        contract's numbers alone; `gate run` refuses a contract whose max_model_len is below it. Default:
        the output cap plus a prompt of at least one token."""
        max_tokens = getattr(workload, "max_tokens", None) or sampling.max_tokens
        return int(max_tokens) + 1


class Subset(BaseModel):
    """Which items of a dataset to use: the first N, or explicit ids (in dataset order)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    first: Optional[int] = Field(default=None, ge=1)
    ids: Optional[list[str]] = None


class TaskWorkload(WorkloadBase):
    """Shared fields of dataset-driven task workloads (GSM8K, HumanEval+, MBPP+, ...)."""

    dataset: Optional[str] = None  # registry name; default chosen by the runner
    subset: Optional[Subset] = None


# Kinds that contracts may name before their runners are installed; `gate run` refuses them up front.
for _kind in ("gsm8k", "humaneval_plus", "mbpp_plus"):
    declare_workload_schema(_kind, TaskWorkload)


# --------------------------------------------------------------------------- helpers for runners
def to_sampling_params(sampling: SamplingSpec, seed: Optional[int] = None, **overrides: Any) -> SamplingParams:
    """Engine SamplingParams from the contract's sampling block: its settings are SamplingParams' own
    (SAMPLING_IN_CONTRACT), so they carry over by name; overrides win. `sampling.reasoning` is not a sampling
    parameter: the engine adapter passes it to the chat template (ArmSettings.reasoning)."""
    settings: dict[str, Any] = {name: getattr(sampling, name) for name in SAMPLING_IN_CONTRACT}
    return SamplingParams(**{**settings, "seed": seed, **overrides})


def prompt_sha256(prompt: Any) -> str:
    if isinstance(prompt, str):
        data = prompt.encode("utf-8")
    else:
        data = repr(prompt).encode("utf-8")
    return hashlib.sha256(data).hexdigest()


def request_record(key: str, output: Any, tokenizer: Any = None, *, prompt: Any = None,
                   natural_stop_eligible: bool = True, **fields: Any) -> RequestRecord:
    """A RequestRecord from an engine RequestOutput, with natural-stop health filled in; when the request
    asked for logprobs, its tokens and each step's logprobs (likeliest first) go into `extra` too, for
    token_hash_equal's near-tie rule."""
    t = output.timings
    health = generation_health(output, tokenizer)
    n = len(output.token_ids)
    if getattr(output, "logprobs", None):
        steps = [sorted(step.items(), key=lambda kv: -kv[1]) for step in output.logprobs]
        fields["extra"] = {**fields.get("extra", {}), "token_ids": list(output.token_ids),
                           "step_logprobs": [[[int(tok), float(lp)] for tok, lp in step] for step in steps]}
    rec = RequestRecord(
        request_key=key,
        prompt_sha256=prompt_sha256(prompt if prompt is not None else (output.prompt or output.prompt_token_ids)),
        num_prompt_tokens=len(output.prompt_token_ids), num_completion_tokens=n,
        num_cached_tokens=getattr(output, "num_cached_tokens", 0) or 0,
        queue_s=t.queue_s, prefill_s=t.prefill_s, ttft_s=t.first_token_s, decode_s=t.decode_s, e2e_s=t.e2e_s,
        tpot_s=(t.decode_s / (n - 1)) if n > 1 else None,
        natural_stop_eligible=natural_stop_eligible,
        spec_num_drafts=output.spec.num_drafts, spec_num_draft_tokens=output.spec.num_draft_tokens,
        spec_num_accepted_tokens=output.spec.num_accepted_tokens,
        spec_accepted_per_position=list(output.spec.accepted_per_position),
        error=output.error, **health, **fields)
    return rec
