"""Side-by-side engine comparison (`onecat bench compare FILE`): the same prompts, sampling and
endpoint workloads against several engines (onecat, vLLM, llama.cpp, any OpenAI endpoint), one
engine at a time, into one table. Unlike a gate contract there is no baseline/candidate verdict:
the output is measured figures. They are stored as one run of kind "compare" in the results store
(each engine's label is its arm: environment, arm_outcomes, requests and metrics rows), so
`onecat results list/query` see it; the JSON and markdown are rendered from those rows
(reports/compare.py).

    name: peers-cpu
    model: {source: "embedded:smollm2-135m-instruct", dtype: float32}
    sampling: {temperature: 0.0, max_tokens: 64}
    seeds: [0]
    engines:                        # label -> engine settings (gates/contract/settings.py EngineSpec)
      onecat: {backend: onecat_serve, max_num_seqs: 16}
      vllm: {backend: vllm_serve, max_num_seqs: 16}
      llama.cpp: {backend: llama_server, max_model_len: 2048, max_num_seqs: 16,
                  model: {dtype: auto, quantization: gguf}}   # an engine's own model settings over the shared ones
    workloads:                      # endpoint workloads (gates/runners/endpoint.py)
      - {kind: endpoint, name: c1, concurrency: 1, num_requests: 4, input_len: 128, output_len: 64}
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Callable, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from onecat.gates.contract import (ArmSettings, ContractError, EngineSpec, ModelOverride, ModelSpec, SamplingSpec,
                                   SpeculativeSpec, canonical_json, load_yaml, read_contract_text, sha256_text)
from onecat.gates.runners.endpoint import EndpointRunner, EndpointWorkload
from onecat.gates.engine_failure import exception_failure, failure_text, unit_failure
from onecat.results.environment import capture_environment, load_1min, machine_record
from onecat.results.records import ArmOutcome, RunRecord, new_run_id
from onecat.results.revision import engine_revision, git_revision, onecat_version
from onecat.results.sink import RunSink
from onecat.results.store import Store


class CompareEngine(EngineSpec):
    """One engine of the comparison: its engine settings, and the model settings it runs differently from the
    shared `model` (e.g. llama.cpp's packed GGUF: {dtype: auto, quantization: gguf})."""

    model: Optional[ModelOverride] = None  # type: ignore[valid-type]
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

    def canonical_json(self) -> str:
        return canonical_json(self.model_dump(mode="json"))

    @property
    def fingerprint(self) -> str:
        return sha256_text(self.canonical_json())


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


def check_labels(spec: CompareSpec, only: Optional[list[str]]) -> list[str]:
    """The engine labels to run, in file order. An `--only` label the file does not have, or an engine
    backend that is not registered, is an error (CompareError) before anything runs."""
    from onecat.gates.registry import ENGINES, RegistryError, lookup

    unknown = [label for label in only or [] if label not in spec.engines]
    if unknown:
        raise CompareError(f"--only {', '.join(unknown)}: no such engine in {spec.name}; its engines: "
                           + ", ".join(spec.engines))
    labels = [label for label in spec.engines if not only or label in only]
    for label in labels:
        try:
            lookup(ENGINES, "engine backend", spec.engines[label].backend)
        except RegistryError as exc:
            raise CompareError(f"engine {label}: {exc}") from None
    return labels


def engine_arm(spec: CompareSpec, label: str) -> ArmSettings:
    """The settings engine `label` is opened with: the shared model with its own model settings over it, its
    engine settings, its speculative decoding, and the sampling's reasoning switch."""
    eng_spec = spec.engines[label]
    model = spec.model
    if eng_spec.model is not None:
        model = ModelSpec.model_validate({**model.model_dump(), **eng_spec.model.model_dump(exclude_none=True)})
    engine = EngineSpec(**eng_spec.model_dump(exclude={"model", "speculative", "description"}))
    return ArmSettings(name=label, model=model, engine=engine, speculative=eng_spec.speculative,
                       reasoning=spec.sampling.reasoning)


def compare_run_record(spec: CompareSpec, run_id: str, labels: list[str], spec_path: Optional[str]) -> RunRecord:
    return RunRecord(run_id=run_id, kind="compare", contract_name=spec.name, contract_fingerprint=spec.fingerprint,
                     contract_json=spec.canonical_json(), contract_path=spec_path,
                     arm_settings={label: spec.engines[label].model_dump(mode="json") for label in labels},
                     engine_revision=engine_revision(), harness_revision=git_revision(),
                     onecat_version=onecat_version())


def run_compare(spec: CompareSpec, store: Store, spec_path: Optional[str] = None, only: Optional[list[str]] = None,
                log: Callable[[str], Any] = print, machine_label: Optional[str] = None) -> str:
    """Run every selected engine, one at a time, into one run of kind "compare" in `store`; returns its id.
    An engine that cannot run here (not installed) is recorded as skipped (why); one whose server dies, or
    whose every request of a unit fails, as failed (gates/engine_failure.py), with its last output."""
    labels = check_labels(spec, only)
    run_id = new_run_id(spec.name)
    machine = machine_record(machine_label)
    store.create_run(compare_run_record(spec, run_id, labels, spec_path))
    with store.recording_stops(run_id, "interrupted by the user"):
        position = 0
        for label in labels:
            position = _run_engine(spec, label, store, run_id, position, machine, log)
    store.set_status(run_id, "complete")
    return run_id


def _run_engine(spec: CompareSpec, label: str, store: Store, run_id: str, position: int, machine: dict,
                log: Callable[[str], Any]) -> int:
    """One engine's workloads into the store (arm = the engine's label); returns the next unit position."""
    from onecat.gates.engines.base import EngineDiedError, open_engine
    from onecat.gates.registry import ENGINES, lookup

    arm = engine_arm(spec, label)
    started = {"machine": machine, "load_1min_at_start": load_1min()}  # what else ran as this engine started
    problems = lookup(ENGINES, "engine backend", arm.engine.backend).check(arm)
    if problems:
        why = "; ".join(problems)
        log(f"{label}: skipped: {why}")
        store.add_environment(run_id, label, capture_environment(started))
        store.add_arm_outcome(run_id, label, ArmOutcome("skipped", error=why))
        return position
    log(f"{label}: opening {arm.engine.backend}")
    t0 = time.perf_counter()
    try:
        engine = open_engine(arm, spec.seeds[0])
    except Exception as exc:  # noqa: BLE001 - one broken peer must not stop the others
        failure = exc.failure if isinstance(exc, EngineDiedError) else {
            "cause": f"could not be opened: {type(exc).__name__}: {exc}", "exit_code": None, "output_tail": ""}
        _record_failure(store, run_id, label, failure, started, None, log)
        return position
    open_s = time.perf_counter() - t0
    info, failure = dict(started), None
    try:
        info = {**engine.info(), **started,
                "load_average_at_open": os.getloadavg() if hasattr(os, "getloadavg") else None}
        store.add_environment(run_id, label, capture_environment(info))
        runner = EndpointRunner()
        for w in spec.workloads:
            for unit in runner.plan(w, spec.sampling, spec.seeds):
                log(f"{label}: {w.id} {unit.key}")
                runner.run_unit(engine, w, spec.sampling, unit, RunSink(store, run_id, label, w.id, unit.key,
                                                                        position))
                store.finish_unit(run_id, label, w.id, unit.key, position)
                position += 1
                failure = unit_failure(engine, store, run_id, label, w.id, unit.key)
                if failure:
                    break
            if failure:
                break
    except Exception as exc:  # noqa: BLE001
        failure = exception_failure(engine, exc)
    finally:
        engine.close()
    if failure:
        _record_failure(store, run_id, label, failure, info, open_s, log)
    else:
        store.add_arm_outcome(run_id, label, ArmOutcome("ran", open_s=open_s))
    return position


def _record_failure(store: Store, run_id: str, label: str, failure: dict, info: dict, open_s: Optional[float],
                    log: Callable[[str], Any]) -> None:
    """A failed engine: `failed` with its cause and last output in arm_outcomes, the failure in its environment
    row's engine info (where the JSON and markdown read it), nothing of it in the figures."""
    log(f"{label}: FAILED: {failure_text(failure)}")
    store.add_environment(run_id, label, capture_environment({**info, "failure": failure}))
    store.add_arm_outcome(run_id, label, ArmOutcome("failed", error=failure_text(failure), open_s=open_s))
