"""structured_output: JSON-schema tasks; every reply's validity against its schema is stored.

Measures per task and seed: `valid` (a JSON value found in the reply validates) and `strict_valid`
(the whole reply is that JSON), plus the first schema errors, next to natural-stop health.
"""
from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field, field_validator

from onecat.gates.contract import SamplingSpec, WorkloadBase
from onecat.gates.engines.base import Engine
from onecat.gates.registry import register_runner
from onecat.gates.runners._task_helpers import PromptSpec, item_seed, generate
from onecat.gates.runners.base import ItemOutcome, Metric, Runner, Sink, Unit, request_record, to_sampling_params
from onecat.gates.tasks import structured


@register_runner("structured_output")
class StructuredOutput(Runner):
    deterministic_when = "greedy"  # --reuse-baseline may copy its rows (Runner.deterministic_evidence)
    class Workload(WorkloadBase):
        kind: Literal["structured_output"] = "structured_output"
        tasks: Optional[list[str]] = None  # task ids from gates/tasks/structured.py; default: all
        max_tokens: Optional[int] = Field(default=None, ge=1)

        @field_validator("tasks")
        @classmethod
        def _known(cls, v):
            unknown = [t for t in v or [] if t not in structured.TASKS_BY_ID]
            if unknown:
                raise ValueError(f"unknown structured tasks {unknown}; known: {sorted(structured.TASKS_BY_ID)}")
            return v

    def plan(self, workload: Workload, sampling: SamplingSpec, seeds: list[int]) -> list[Unit]:
        n = len(workload.tasks or structured.TASKS)
        return [Unit(key=f"seed={s}", seed=s, size=n) for s in seeds]

    def run_unit(self, engine: Engine, workload: Workload, sampling: SamplingSpec, unit: Unit, sink: Sink) -> None:
        tasks = [structured.TASKS_BY_ID[t] for t in workload.tasks] if workload.tasks else list(structured.TASKS)
        seed = unit.seed
        sink.metric(Metric(name="task_items", value=float(len(tasks)), unit="items", key=f"subset/seed={seed}",
                           tags={"subset": [t.task_id for t in tasks]}))
        todo = [t for t in tasks if not sink.is_done(f"{t.task_id}/seed={seed}")]
        if todo:
            overrides = {"max_tokens": workload.max_tokens} if workload.max_tokens else {}
            params = [to_sampling_params(sampling, seed=item_seed(seed, t.task_id), **overrides) for t in todo]
            outs, replies, modes, sent = generate(engine, [PromptSpec(messages=t.messages()) for t in todo], params)
            for t, out, reply, prompt in zip(todo, outs, replies, sent):
                key = f"{t.task_id}/seed={seed}"
                v = structured.check_reply(reply, t)
                capped = out.finish_reason == "length"
                extra = {"method": v.method, "errors": list(v.errors), "parsed": v.parsed,
                         "capped_with_valid_json": capped and v.valid}
                sink.request(request_record(key, out, engine.tokenizer, prompt=prompt, seed=seed, extra=extra))
                reason = None if v.valid else ("engine_error" if out.error else
                                               "capped_invalid" if capped else
                                               "schema_violation" if v.parsed else "no_json")
                sink.item(ItemOutcome(item_id=t.task_id, seed=seed, failure_reason=reason,
                                      passed={"valid": v.valid, "strict_valid": v.strict_valid}, extra=extra),
                          request_key=key)
        sink.advance(unit.size)
