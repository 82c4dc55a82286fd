"""lm_eval: any lm-eval task, run in each arm through the engine (gates/tasks/lm_eval_bridge.py).

The task comes by name (an lm-eval task whose data is in the local datasets cache) or from a local
YAML task folder (`include_path`, with local data files). Every document's per-sample metrics are
stored as the item's measures (`acc`, `exact_match`, ... where a metric is 0/1), so `task_score`'s
paired McNemar test applies to lm-eval tasks as to the harness's own; lm-eval's aggregate for the
arm is stored in the item extras. lm-eval is a test dependency: on a machine without it the workload
fails with a message saying so. Datasets are read offline (HF_DATASETS_OFFLINE): a task whose data
is neither local nor in the datasets cache fails instead of downloading.
"""
from __future__ import annotations

import os
from typing import Literal, Optional

from pydantic import Field

from onecat.gates.contract import SamplingSpec
from onecat.gates.engines.base import Engine
from onecat.gates.registry import register_runner
from onecat.gates.runners.base import ItemOutcome, Runner, Sink, Unit, WorkloadBase


@register_runner("lm_eval")
class LmEval(Runner):
    deterministic_when = "greedy"

    class Workload(WorkloadBase):
        kind: Literal["lm_eval"] = "lm_eval"
        task: str  # an lm-eval task name (or one defined under include_path)
        include_path: Optional[str] = None  # a folder of lm-eval task YAMLs (relative: to the working dir)
        limit: Optional[int] = Field(default=None, ge=1)  # first N documents
        num_fewshot: Optional[int] = Field(default=None, ge=0)
        max_gen_toks: int = Field(default=256, ge=1)

    def plan(self, workload: Workload, sampling: SamplingSpec, seeds: list[int]) -> list[Unit]:
        return [Unit(key="all", seed=seeds[0] if seeds else 0, size=1, params=())]

    def run_unit(self, engine: Engine, workload: Workload, sampling: SamplingSpec, unit: Unit, sink: Sink) -> None:
        try:
            from lm_eval import simple_evaluate
            from lm_eval.tasks import TaskManager
        except ImportError as exc:
            raise RuntimeError("the lm_eval workload needs lm-eval (pip install 'lm-eval[api]'); "
                               f"it is not importable here: {exc}") from None
        from onecat.gates.tasks.lm_eval_bridge import make_lm

        os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # the harness never fetches data mid-run

        result = simple_evaluate(model=make_lm(engine, workload.max_gen_toks), tasks=[workload.task],
                                 task_manager=TaskManager(include_path=workload.include_path),
                                 limit=workload.limit, num_fewshot=workload.num_fewshot, log_samples=True,
                                 bootstrap_iters=0, random_seed=unit.seed)
        aggregate = {k: v for k, v in result["results"].get(workload.task, {}).items()
                     if isinstance(v, (int, float))}
        for sample in result["samples"][workload.task]:
            passed = {m: bool(sample[m]) for m in sample.get("metrics", []) if sample.get(m) in (0, 1, True, False)}
            if not passed:
                raise RuntimeError(f"lm-eval task {workload.task!r} has no 0/1 per-document metric to gate on "
                                   f"(metrics: {sample.get('metrics')})")
            sink.item(ItemOutcome(item_id=f"{workload.task}/{sample['doc_id']}", seed=unit.seed, passed=passed,
                                  failure_reason=None if all(passed.values()) else "wrong_answer",
                                  extra={"lm_eval_aggregate": aggregate}))
        sink.advance(unit.size)
