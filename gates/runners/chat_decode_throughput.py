"""chat_decode_throughput: decode speed on held-out chat prompts, A/B/A repeats per batch size.

Synthetic random-token prompts (decode_throughput) say nothing about a drafter trained on real
text: every drafter fails on them. This workload times real questions instead: GSM8K test
questions (the gsm8k runner's zero-shot chat prompt) or EvalPlus HumanEval+ / MBPP+ tasks (EvalPlus's
chat prompt, assistant turn pre-filled up to an open code fence), through the model's chat
template. Each unit runs every selected prompt once, `batch_size` at a time; both arms get the same
prompts in the same order, and units alternate between arms (the baseline runs one extra repeat).

Metrics per (batch size, repeat): decode_tok_s, or spec_decode_tok_s when the arm speculates (tokens
after the first over the batches' decode time: from a batch's first first-token to its last finish),
acceptance_length when it drafted, output_tok_s, wall_s. Generations stop naturally unless
`ignore_eos`; the rows are speed rows and do not count for natural-stop rates (a gsm8k workload
does that once per question, without repeats).

    - {kind: chat_decode_throughput, dataset: gsm8k, subset: {first: 4}, output_len: 128,
       batch_sizes: [1], repeats: 3}
"""
from __future__ import annotations

import time
from typing import Literal, Optional

from pydantic import Field, field_validator, model_validator

from onecat.gates.contract import SamplingSpec, WorkloadBase
from onecat.gates.engines.base import Engine
from onecat.gates.registry import register_runner
from onecat.gates.runners._task_helpers import PromptSpec, generate, item_seed, record_subset
from onecat.gates.runners._throughput import ThroughputRunner
from onecat.gates.runners.base import Metric, Sink, Unit, request_record, to_sampling_params
from onecat.gates.tasks import evalplus_data, gsm8k
from onecat.gates.tasks.subset import TaskSubset, select
from onecat.results.records import is_failed_request

PromptFormat = Literal["gsm8k", "humaneval", "mbpp"]
# the registered datasets whose prompt format follows from their name
FORMAT_OF_DATASET: dict[str, str] = {"gsm8k": "gsm8k", "gsm8k_sample": "gsm8k", "humaneval_plus": "humaneval",
                                     "mbpp_plus": "mbpp"}
WARMUP_TOKENS = 16  # a warm-up generation runs a few decode (and draft/verify) rounds, not a full answer


def prompt_format(dataset: str, given: Optional[str] = None) -> str:
    """The prompt format of `dataset`: `given`, or the one its registered name implies."""
    fmt = given or FORMAT_OF_DATASET.get(dataset)
    if fmt is None:
        raise ValueError(f"dataset {dataset!r} has no known prompt format; set prompt_format to one of gsm8k, "
                         f"humaneval, mbpp (datasets with a known format: {', '.join(FORMAT_OF_DATASET)})")
    return fmt


def chat_prompts(text: str, fmt: str, subset: Optional[TaskSubset] = None) -> list[tuple[str, PromptSpec]]:
    """(item id, chat prompt) for the selected items of a dataset file's text, in dataset order: the prompts
    the gsm8k and EvalPlus runners send in chat format."""
    if fmt == "gsm8k":
        items = select(gsm8k.parse_items(text), subset, lambda x: x.item_id)
        return [(it.item_id, PromptSpec(messages=gsm8k.chat_messages(it))) for it in items]
    problems = select(evalplus_data.parse_problems(text, fmt), subset, lambda p: p.task_id)
    prefill = evalplus_data.chat_response_prefix()
    return [(p.task_id, PromptSpec(messages=evalplus_data.chat_messages(p), prefill=prefill)) for p in problems]


def decode_span(batches: list[list]) -> tuple[int, float]:
    """(tokens decoded after each request's first, seconds decoding) over batches run one after another: a
    batch decodes from its first first-token to its last finish."""
    decoded = sum(max(len(o.token_ids) - 1, 0) for b in batches for o in b)
    seconds = sum(max(o.timings.e2e_s for o in b) - min(o.timings.first_token_s for o in b) for b in batches if b)
    return decoded, seconds


@register_runner("chat_decode_throughput")
class ChatDecodeThroughput(ThroughputRunner):
    class Workload(WorkloadBase):
        kind: Literal["chat_decode_throughput"] = "chat_decode_throughput"
        dataset: str = "gsm8k"
        prompt_format: Optional[PromptFormat] = None  # default: from the dataset name (FORMAT_OF_DATASET)
        subset: Optional[TaskSubset] = None  # default: every item (GSM8K test has 1319)
        output_len: int = Field(ge=1)  # new tokens per request at most
        ignore_eos: bool = False  # true: every request runs to output_len (past the end of its answer)
        batch_sizes: list[int] = Field(default=[1], min_length=1)
        repeats: int = Field(default=3, ge=1)
        warmup: int = Field(default=1, ge=0)  # un-timed short batches per (arm, batch size) before measuring

        @field_validator("batch_sizes")
        @classmethod
        def _distinct_positive(cls, v: list[int]) -> list[int]:
            if any(b < 1 for b in v) or len(set(v)) != len(v):
                raise ValueError(f"batch_sizes must be distinct positive integers, got {v}")
            return v

        @model_validator(mode="after")
        def _known_format(self):
            prompt_format(self.dataset, self.prompt_format)
            return self

    def __init__(self) -> None:
        super().__init__()
        self._prompts: dict[tuple, list[tuple[str, PromptSpec]]] = {}

    def min_request_tokens(self, workload: Workload, sampling: SamplingSpec) -> int:
        return workload.output_len + 1  # prompt lengths are the dataset's, known once it is read

    def prompts(self, workload: Workload, sink: Sink) -> list[tuple[str, PromptSpec]]:
        ds = sink.dataset(workload.dataset)
        key = (ds.sha256, workload.model_dump_json())
        if key not in self._prompts:
            fmt = prompt_format(workload.dataset, workload.prompt_format)
            self._prompts[key] = chat_prompts(ds.read_text(), fmt, workload.subset)
        return self._prompts[key]

    def run_unit(self, engine: Engine, workload: Workload, sampling: SamplingSpec, unit: Unit, sink: Sink) -> None:
        bs = dict(unit.params)["batch_size"]
        prompts = self.prompts(workload, sink)
        record_subset(sink, workload, sink.dataset(workload.dataset), [i for i, _ in prompts], unit.seed)
        seed = unit.seed or 0

        def params(item_id: str, max_tokens: int):
            return to_sampling_params(sampling, seed=item_seed(seed, item_id), max_tokens=max_tokens,
                                      ignore_eos=workload.ignore_eos)

        warm_key = (id(engine), workload.id, bs)
        if warm_key not in self._warm:
            for _ in range(workload.warmup):
                first = prompts[:bs]
                generate(engine, [s for _, s in first],
                         [params(i, min(WARMUP_TOKENS, workload.output_len)) for i, _ in first])
            self._warm.add(warm_key)
        batches = []
        t0 = time.perf_counter()
        for start in range(0, len(prompts), bs):
            chosen = prompts[start:start + bs]
            outs, _, _, sent = generate(engine, [s for _, s in chosen],
                                        [params(i, workload.output_len) for i, _ in chosen])
            for (item_id, _), out, prompt in zip(chosen, outs, sent):
                sink.request(request_record(f"{unit.key}/{item_id}", out, engine.tokenizer, prompt=prompt,
                                            natural_stop_eligible=False, seed=unit.seed, repeat=unit.repeat,
                                            batch_size=bs, determinism_group=f"bs={bs}/{item_id}"))
            batches.append(outs)
        wall = time.perf_counter() - t0
        self.speculative = bool((engine.info() or {}).get("speculative"))
        if any(is_failed_request(o) for outs in batches for o in outs):
            sink.advance(1)  # a unit with a failed request times nothing real: its rows say why, no figure
            return
        self.emit_unit_metrics(batches, wall, bs, unit, sink)

    def emit_unit_metrics(self, batches: list[list], wall: float, bs: int, unit: Unit, sink: Sink) -> None:
        outs = [o for batch in batches for o in batch]
        decoded, decode_s = decode_span(batches)
        drafts = sum(o.spec.num_drafts for o in outs)

        def m(name: str, value: float, unit_name: str) -> None:
            sink.metric(Metric(name=name, value=value, unit=unit_name, key=f"bs={bs}", repeat=unit.repeat,
                               seed=unit.seed))

        m("wall_s", wall, "s")
        m("output_tok_s", sum(len(o.token_ids) for o in outs) / max(wall, 1e-9), "tok/s")
        if decoded:
            # speculative and target-only decode rates are different metrics, never one as the other
            speculative = drafts > 0 or self.speculative
            m("spec_decode_tok_s" if speculative else "decode_tok_s", decoded / max(decode_s, 1e-9), "tok/s")
        if drafts:
            m("acceptance_length", 1.0 + sum(o.spec.num_accepted_tokens for o in outs) / drafts, "tokens/round")
        sink.advance(1)
