"""ppl: perplexity on fixed token segments of a text dataset, per-segment NLL stored for pairing.

The text is tokenized once; segment i is tokens [offset + i*segment_len, offset + (i+1)*segment_len).
Each segment is one resumable unit that stores `segment_nll` (sum of -log p over the segment's
tokens after the first) and `segment_tokens` (how many were scored), keyed "segment=i", so the
ppl_delta check can pair segments across arms. `ppl` (over finished segments) is stored at the end.
"""
from __future__ import annotations

import math
from typing import Literal

from pydantic import Field

from onecat.gates.contract import SamplingSpec, WorkloadBase
from onecat.gates.engines.base import Engine
from onecat.gates.registry import register_runner
from onecat.gates.runners.base import Metric, Runner, Sink, Unit

CHARS_PER_TOKEN_GUESS = 3


@register_runner("ppl")
class Perplexity(Runner):
    deterministic_when = "always"  # --reuse-baseline may copy its rows (Runner.deterministic_evidence)
    class Workload(WorkloadBase):
        kind: Literal["ppl"] = "ppl"
        dataset: str  # e.g. wikitext2 (CI) or calibration_wiki (package-shipped)
        segments: int = Field(ge=1)
        segment_len: int = Field(ge=2)
        offset_tokens: int = Field(default=0, ge=0)

    def __init__(self) -> None:
        self._tokens: dict[tuple, list[int]] = {}

    def min_request_tokens(self, workload: Workload, sampling: SamplingSpec) -> int:
        return workload.segment_len + 1  # a scored prompt must be shorter than max_model_len

    def plan(self, workload: Workload, sampling: SamplingSpec, seeds: list[int]) -> list[Unit]:
        return [Unit(key=f"segment={i}", params=(("segment", i),)) for i in range(workload.segments)]

    def _token_stream(self, engine: Engine, workload: Workload, sink: Sink) -> list[int]:
        ds = sink.dataset(workload.dataset)
        cache_key = (ds.sha256, id(engine.tokenizer))
        need = workload.offset_tokens + workload.segments * workload.segment_len
        if cache_key not in self._tokens:
            text = ds.read_text()
            chars = need * CHARS_PER_TOKEN_GUESS
            while True:
                ids = engine.tokenizer.encode(text[:chars])
                if len(ids) >= need + 1 or chars >= len(text):
                    break
                chars *= 2
            if len(ids) < need:
                raise ValueError(f"dataset {workload.dataset} has {len(ids)} tokens, the ppl workload needs {need} "
                                 "(lower segments / segment_len / offset_tokens)")
            self._tokens[cache_key] = ids[:need]
        return self._tokens[cache_key]

    def run_unit(self, engine: Engine, workload: Workload, sampling: SamplingSpec, unit: Unit, sink: Sink) -> None:
        i = dict(unit.params)["segment"]
        ids = self._token_stream(engine, workload, sink)
        start = workload.offset_tokens + i * workload.segment_len
        segment = ids[start:start + workload.segment_len]
        out = engine.score([segment])[0]
        nll = -float(sum(out.logprobs))
        if not math.isfinite(nll):
            raise ValueError(f"segment {i}: non-finite NLL {nll}")
        sink.metric(Metric(name="segment_nll", value=nll, unit="nats", key=unit.key))
        sink.metric(Metric(name="segment_tokens", value=len(out.logprobs), unit="tokens", key=unit.key))
        sink.metric(Metric(name="segment_ppl", value=math.exp(nll / max(len(out.logprobs), 1)), unit="ppl",
                           key=unit.key))
        sink.advance(1)
