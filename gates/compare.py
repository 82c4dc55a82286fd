"""Side-by-side engine comparison (`onecat bench compare FILE`): the same prompts, sampling and
endpoint workloads against several engines (onecat, vLLM, llama.cpp, any OpenAI endpoint), one
engine at a time, into one table. Unlike a gate contract there is no baseline/candidate verdict:
the output is measured figures, written as JSON and markdown.

    name: peers-cpu
    model: {source: "embedded:smollm2-135m-instruct", dtype: float32}
    sampling: {temperature: 0.0, max_tokens: 64}
    seeds: [0]
    engines:                        # label -> engine settings (gates/contract.py EngineSpec)
      onecat: {backend: onecat_serve, max_num_seqs: 16}
      vllm: {backend: vllm_serve, max_num_seqs: 16}
    workloads:                      # endpoint workloads (gates/runners/endpoint.py)
      - {kind: endpoint, name: c1, concurrency: 1, num_requests: 4, input_len: 128, output_len: 64}
"""
from __future__ import annotations

import json
import platform
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from onecat.gates.contract import ArmSettings, ContractError, EngineSpec, ModelSpec, SamplingSpec, SpeculativeSpec
from onecat.gates.contract_yaml import load_yaml, read_contract_text
from onecat.gates.runners.endpoint import EndpointRunner, EndpointWorkload

SHOWN = [("output_tok_s", "output tok/s", "{:.1f}"), ("request_throughput", "req/s", "{:.2f}"),
         ("ttft_p50_s", "TTFT p50 s", "{:.3f}"), ("ttft_p90_s", "TTFT p90 s", "{:.3f}"),
         ("tpot_p50_s", "TPOT p50 s", "{:.4f}"), ("itl_p90_s", "ITL p90 s", "{:.4f}"),
         ("e2e_p50_s", "e2e p50 s", "{:.2f}"), ("num_failed", "failed", "{:.0f}")]


class CompareEngine(EngineSpec):
    speculative: Optional[SpeculativeSpec] = None
    description: str = ""


class CompareSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    description: str = ""
    model: ModelSpec
    sampling: SamplingSpec = Field(default_factory=SamplingSpec)
    seeds: list[int] = Field(default_factory=lambda: [0], min_length=1)
    engines: dict[str, CompareEngine] = Field(min_length=1)
    workloads: list[EndpointWorkload] = Field(min_length=1)


class CompareError(ValueError):
    pass


def load_compare(path: str | Path) -> CompareSpec:
    p = Path(path)
    if not p.is_file():
        raise CompareError(f"{path}: file not found")
    try:  # the contract reader's bounds (size, nesting, aliases, finite numbers) apply to this file too
        data, _ = load_yaml(read_contract_text(p, str(path)), str(path))
        return CompareSpec.model_validate(data, strict=True)
    except ContractError as exc:
        raise CompareError(str(exc)) from None
    except ValidationError as exc:
        raise CompareError(f"{path}: invalid comparison file:\n{exc}") from None


class _Collect:
    arm = workload_id = ""

    def __init__(self):
        self.requests: list = []
        self.metrics: list = []

    def request(self, r):
        self.requests.append(r)

    def metric(self, m):
        self.metrics.append(m)

    def advance(self, n: int = 1):
        pass

    def is_done(self, key: str) -> bool:
        return False


def run_compare(spec: CompareSpec, only: list[str] | None = None, log: Any = print) -> dict:
    from onecat.gates.engines.base import open_engine
    from onecat.gates.registry import ENGINES, lookup

    results: dict[str, Any] = {}
    for label, eng_spec in spec.engines.items():
        if only and label not in only:
            continue
        engine_fields = eng_spec.model_dump(exclude={"speculative", "description"})
        arm = ArmSettings(name=label, model=spec.model, engine=EngineSpec(**engine_fields),
                          speculative=eng_spec.speculative)
        entry: dict[str, Any] = {"backend": eng_spec.backend, "description": eng_spec.description}
        results[label] = entry
        cls = lookup(ENGINES, "engine backend", arm.engine.backend)
        problems = cls.check(arm)
        if problems:
            entry["skipped"] = "; ".join(problems)
            log(f"{label}: skipped: {entry['skipped']}")
            continue
        log(f"{label}: opening {arm.engine.backend}")
        t0 = time.perf_counter()
        try:
            engine = open_engine(arm, spec.seeds[0])
        except Exception as exc:  # noqa: BLE001 - one broken peer must not stop the others
            entry["skipped"] = f"{type(exc).__name__}: {exc}"
            log(f"{label}: failed to open: {entry['skipped']}")
            continue
        entry["open_s"] = time.perf_counter() - t0
        try:
            entry["info"] = engine.info()
            runner = EndpointRunner()
            entry["workloads"] = {}
            for w in spec.workloads:
                sink = _Collect()
                for unit in runner.plan(w, spec.sampling, spec.seeds):
                    log(f"{label}: {w.id} {unit.key}")
                    runner.run_unit(engine, w, spec.sampling, unit, sink)
                agg: dict[str, list[float]] = {}
                for m in sink.metrics:
                    if not m.tags.get("position"):
                        agg.setdefault(m.name, []).append(m.value)
                entry["workloads"][w.id] = {k: sum(v) / len(v) for k, v in agg.items()}
                errors = [r.error for r in sink.requests if r.error]
                if errors:
                    entry["workloads"][w.id]["first_error"] = errors[0]
        except Exception as exc:  # noqa: BLE001
            entry["error"] = f"{type(exc).__name__}: {exc}"
            log(f"{label}: failed: {entry['error']}")
        finally:
            engine.close()
    return {"name": spec.name, "description": spec.description, "model": spec.model.model_dump(),
            "sampling": spec.sampling.model_dump(), "seeds": spec.seeds,
            "workloads": [w.model_dump() for w in spec.workloads], "engines": results,
            "when": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "machine": {"cpu": platform.processor() or platform.machine(), "python": platform.python_version()},
            "kind": "measured"}


def render_markdown(record: dict) -> str:
    lines = [f"# {record['name']}", "", record.get("description", ""), "",
             f"Measured {record['when']} on {record['machine']['cpu']}; model {record['model']['source']}; "
             f"sampling {json.dumps(record['sampling'])}.", ""]
    for w in record["workloads"]:
        wid = w.get("name") or w["kind"]
        mode = f"concurrency {w['concurrency']}" if w.get("concurrency") else f"rate {w.get('request_rate')} req/s"
        lines += [f"## {wid}: {mode}, {w['num_requests']} requests, ~{w['input_len']} in / {w['output_len']} out", "",
                  "| engine | " + " | ".join(h for _, h, _ in SHOWN) + " |",
                  "|---|" + "---:|" * len(SHOWN)]
        for label, entry in record["engines"].items():
            if "skipped" in entry:
                lines.append(f"| {label} | skipped: {entry['skipped'][:120]} |" + " |" * (len(SHOWN) - 1))
                continue
            vals = entry.get("workloads", {}).get(wid, {})
            cells = [fmt.format(vals[k]) if k in vals else "-" for k, _, fmt in SHOWN]
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)
