"""humaneval_plus / mbpp_plus: EvalPlus code generation, checked in the sandbox, base and plus.

Prompts are EvalPlus's: `chat` puts the task in a fence after EvalPlus's instruction and pre-fills
the assistant turn up to an open ```python fence (plain chat when the engine cannot render the
template); `completion` gives the raw prompt to continue. Code is extracted and sanitized from
the reply, then run against the canonical solution's outputs (gates/tasks/evalplus.py). Per task:
measures base and plus (plus requires base), failure reason and where it failed, extraction
method, whether a length-capped reply still held the function, and the sandbox time.
"""
from __future__ import annotations

import time
from typing import Any, Literal, Optional

from pydantic import Field

from onecat.gates.contract import SamplingSpec
from onecat.gates.engines.base import Engine
from onecat.gates.registry import register_runner
from onecat.gates.runners._task_helpers import PromptSpec, item_seed, chunk_units, generate, record_subset
from onecat.gates.runners.base import (ItemOutcome, Metric, Runner, Sink, TaskWorkload, Unit, request_record,
                                       to_sampling_params)
from onecat.gates.tasks import evalplus_data
from onecat.gates.tasks.code_extract import extract_code
from onecat.gates.tasks.evalplus import ReferenceCache, check_many
from onecat.gates.tasks.subset import TaskSubset, select

# EvalPlus's stop strings for base-model (completion) generation
COMPLETION_STOP = ["\nif __name__", "\ndef main(", "\nprint(", "\n```\n"]


class _EvalPlusRunner(Runner):
    deterministic_when = "greedy"  # --reuse-baseline may copy its rows (Runner.deterministic_evidence)
    dataset_kind: str = "humaneval"

    class Workload(TaskWorkload):
        kind: str
        subset: Optional[TaskSubset] = None
        style: Literal["chat", "completion"] = "chat"
        max_tokens: Optional[int] = Field(default=None, ge=1)  # default: sampling.max_tokens
        chunk: int = Field(default=16, ge=1)  # tasks per engine call and per resumable unit
        eval_workers: Optional[int] = Field(default=None, ge=1)  # parallel sandboxes; default: CPU count

    def __init__(self) -> None:
        self._problems: dict[str, list] = {}

    def _load(self, workload: Workload, sink: Sink) -> tuple[Any, list]:
        ds = sink.dataset(workload.dataset)
        if ds.sha256 not in self._problems:
            self._problems[ds.sha256] = evalplus_data.parse_problems(ds.read_text(), self.dataset_kind)
        return ds, select(self._problems[ds.sha256], workload.subset, lambda p: p.task_id)

    def plan(self, workload: Workload, sampling: SamplingSpec, seeds: list[int]) -> list[Unit]:
        return [Unit(key=f"seed={s}", seed=s, size=1, params=(("seed", s),)) for s in seeds]

    def run_unit(self, engine: Engine, workload: Workload, sampling: SamplingSpec, unit: Unit, sink: Sink) -> None:
        ds, problems = self._load(workload, sink)
        record_subset(sink, workload, ds, [p.task_id for p in problems], unit.seed)
        cache = ReferenceCache(ds.sha256)
        for sub in chunk_units(len(problems), [unit.seed], workload.chunk):
            p = dict(sub.params)
            self._run_chunk(engine, workload, sampling, unit.seed, problems[p["start"]:p["start"] + p["count"]],
                            cache, sink)
        sink.advance(unit.size)

    def _run_chunk(self, engine, workload, sampling, seed, problems, cache, sink) -> None:
        todo = [p for p in problems if not sink.is_done(f"{p.task_id}/seed={seed}")]
        if not todo:
            return
        overrides: dict[str, Any] = {}
        if workload.max_tokens:
            overrides["max_tokens"] = workload.max_tokens
        completion = workload.style == "completion"
        if completion:
            overrides["stop"] = list(dict.fromkeys(list(sampling.stop) + COMPLETION_STOP))
            specs = [PromptSpec(text=evalplus_data.completion_prompt(p)) for p in todo]
        else:
            specs = [PromptSpec(messages=evalplus_data.chat_messages(p), prefill=evalplus_data.chat_response_prefix())
                     for p in todo]
        params = [to_sampling_params(sampling, seed=item_seed(seed, p.task_id), **overrides) for p in todo]
        outs, replies, modes, sent = generate(engine, specs, params)
        extracted = [extract_code(r, p.entry_point, p.prompt, completion_style=completion)
                     for p, r in zip(todo, replies)]
        start = time.monotonic()
        results = check_many([(p, ex.code if ex.has_entry_point else "") for p, ex in zip(todo, extracted)],
                             cache, workers=workload.eval_workers)
        eval_wall = time.monotonic() - start
        for p, out, ex, res, mode, prompt in zip(todo, outs, extracted, results, modes, sent):
            key = f"{p.task_id}/seed={seed}"
            capped = out.finish_reason == "length"
            reason = res.failure_reason
            if not ex.has_entry_point:
                reason = "capped_no_code" if capped else "no_code"
            extra = {"style": workload.style, "prompt_mode": mode, "code_method": ex.method,
                     "has_entry_point": ex.has_entry_point, "trimmed_lines": ex.trimmed_lines,
                     "capped_with_code": capped and ex.has_entry_point, "failed_set": res.failed_set,
                     "failed_index": res.failed_index, "detail": res.detail, "eval_s": round(res.eval_s, 4),
                     "sandbox": res.sandbox, "sandbox_fs": res.filesystem}
            sink.request(request_record(key, out, engine.tokenizer, prompt=prompt, seed=seed, extra=extra))
            sink.item(ItemOutcome(item_id=p.task_id, seed=seed, failure_reason=None if res.plus_pass else reason,
                                  passed={"base": res.base_pass, "plus": res.plus_pass}, extra=extra),
                      request_key=key)
        sink.metric(Metric(name="sandbox_eval_s_per_task", value=eval_wall / len(todo), unit="s", seed=seed,
                           key=f"seed={seed}/{todo[0].task_id}..{todo[-1].task_id}",
                           tags={"tasks": len(todo), "workers": workload.eval_workers or "cpu_count"}))


@register_runner("humaneval_plus")
class HumanEvalPlus(_EvalPlusRunner):
    dataset_kind = "humaneval"

    class Workload(_EvalPlusRunner.Workload):
        kind: Literal["humaneval_plus"] = "humaneval_plus"
        dataset: str = "humaneval_plus"


@register_runner("mbpp_plus")
class MbppPlus(_EvalPlusRunner):
    dataset_kind = "mbpp"

    class Workload(_EvalPlusRunner.Workload):
        kind: Literal["mbpp_plus"] = "mbpp_plus"
        dataset: str = "mbpp_plus"
