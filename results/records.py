"""The rows a run stores, as dataclasses, and the one rule that turns a record into table columns.

Each field is stored in the column of the same name; a structured field (a dict or a list) is stored
as canonical JSON text in `<field>_json`. The store builds its INSERTs from these records
(`column_values`), and tests/test_store_schema.py holds every table's DDL to them, so a field added
here without a migration (or the other way round) fails a test instead of landing in a wrong column.

    RunRecord      -> runs           (one per `gate run` or `bench compare`; kind says which)
    Environment    -> environment    (one per arm: machine, software, effective fast paths)
    ArmOutcome     -> arm_outcomes   (per arm: ran, skipped or failed and why; the environment class its
                                      evidence holds for, and the evidence it reused from an earlier run)
    RequestRecord  -> requests       (one per engine request)
    ItemOutcome    -> item_outcomes  (one row per measure of a task item)
    Metric         -> metrics        (a figure; measured or projected, never mixed)
"""
from __future__ import annotations

import dataclasses
import functools
import json
import time
import typing
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional

FAILED_FINISH_REASONS = ("abort", "error")
METRIC_KINDS = ("measured", "projected")
RUN_KINDS = ("gate", "compare")
ARM_STATUSES = ("ran", "skipped", "failed")


@dataclass
class RunRecord:
    """What identifies a run and makes it comparable; status, times and writer are the store's."""

    run_id: str
    contract_name: str
    contract_fingerprint: str
    contract_json: str
    kind: str = "gate"  # "gate" (baseline vs candidate, a verdict) or "compare" (engines side by side)
    contract_path: Optional[str] = None
    baseline_fingerprint: Optional[str] = None
    candidate_fingerprint: Optional[str] = None
    arm_settings: dict[str, Any] = field(default_factory=dict)  # arm name -> effective settings
    dataset_sha256: dict[str, str] = field(default_factory=dict)
    engine_revision: Optional[str] = None
    harness_revision: Optional[str] = None
    onecat_version: Optional[str] = None

    def __post_init__(self) -> None:
        if self.kind not in RUN_KINDS:
            raise ValueError(f"run kind {self.kind!r}; use one of {', '.join(RUN_KINDS)}")


def new_run_id(name: str) -> str:
    """`<name>-<UTC time>-<random>`: sorts by start time, unique without asking the store."""
    return f"{name}-{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}-{uuid.uuid4().hex[:6]}"


@dataclass
class Environment:
    """The machine and software an arm measured on, with the engine's effective fast paths."""

    hostname: Optional[str] = None
    platform: Optional[str] = None
    python_version: Optional[str] = None
    cpu_model: Optional[str] = None
    cpu_threads: Optional[int] = None
    torch_threads: Optional[int] = None
    gpu_name: Optional[str] = None
    gpu_count: Optional[int] = None
    gpu_driver: Optional[str] = None
    torch_version: Optional[str] = None
    cuda_version: Optional[str] = None
    device: Optional[str] = None
    kv_cache_dtype: Optional[str] = None
    attention_backend: Optional[str] = None
    cuda_graph: Optional[str] = None
    prefix_caching: Optional[str] = None
    model_sha256: Optional[str] = None
    engine_info: dict[str, Any] = field(default_factory=dict)  # what the engine reported, as it reported it


@dataclass
class ArmOutcome:
    """Whether an arm's engine ran; a skipped or failed arm says why (`error`). A gate run also records the
    arm's environment class (what deterministic evidence may be reused across: gates/baseline_reuse.py) and,
    with --reuse-baseline, which workloads' rows were copied from which earlier run."""

    status: str  # ran | skipped | failed
    error: Optional[str] = None
    open_s: Optional[float] = None  # seconds to open the engine
    environment_class: dict[str, Any] = field(default_factory=dict)  # device, device name, torch, engine code
    reused_evidence: dict[str, Any] = field(default_factory=dict)  # workload -> {"run_id", "arm"} copied from

    def __post_init__(self) -> None:
        if self.status not in ARM_STATUSES:
            raise ValueError(f"arm status {self.status!r}; use one of {', '.join(ARM_STATUSES)}")


@dataclass
class RequestRecord:
    """One engine request as stored in the `requests` table."""

    request_key: str  # unique within (run, arm, workload); --resume skips keys already stored
    determinism_group: Optional[str] = None  # requests expected to produce identical tokens
    seed: Optional[int] = None
    repeat: Optional[int] = None
    batch_size: Optional[int] = None
    prompt_sha256: Optional[str] = None
    num_prompt_tokens: int = 0
    num_completion_tokens: int = 0
    num_cached_tokens: int = 0
    queue_s: Optional[float] = None
    prefill_s: Optional[float] = None
    ttft_s: Optional[float] = None
    decode_s: Optional[float] = None
    e2e_s: Optional[float] = None
    tpot_s: Optional[float] = None
    finish_reason: Optional[str] = None
    natural_stop_eligible: bool = True  # False when the runner forced the length (ignore_eos)
    natural_stop: Optional[bool] = None
    capped: Optional[bool] = None
    max_repeat_run: Optional[int] = None
    repetition_loop: Optional[bool] = None
    replacement_chars: Optional[int] = None
    token_sha256: Optional[str] = None
    text_sha256: Optional[str] = None
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_position: list[int] = field(default_factory=list)
    error: Optional[str] = None
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class ItemOutcome:
    """A task item's result for one seed: what a task_score check compares between arms. Stored as one
    row per measure (columns `measure`, `passed`); a missing seed is stored as -1."""

    item_id: str
    passed: dict[str, bool]  # measure -> passed, e.g. {"base": True, "plus": False}
    seed: Optional[int] = None
    failure_reason: Optional[str] = None  # e.g. "no_answer", "wrong_answer", "timeout", "syntax_error"
    extracted_answer: Optional[str] = None
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class Metric:
    """A figure in the `metrics` table. kind: "measured" or "projected" (never mixed)."""

    name: str
    value: float
    unit: str
    key: str = ""  # what it is a figure of, e.g. "bs=8" or "segment=3"
    kind: str = "measured"
    seed: Optional[int] = None
    repeat: Optional[int] = None
    tags: dict[str, Any] = field(default_factory=dict)


def is_failed_request(row: Any) -> bool:
    """A stored request row (dict) or a RequestRecord that errored or was aborted: never evidence."""
    get = row.get if isinstance(row, dict) else (lambda k: getattr(row, k, None))
    return bool(get("error")) or get("finish_reason") in FAILED_FINISH_REASONS


def canonical_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, default=str)


@functools.lru_cache(maxsize=None)
def _structured(record_type: type) -> frozenset[str]:
    hints = typing.get_type_hints(record_type)
    return frozenset(f.name for f in dataclasses.fields(record_type)
                     if typing.get_origin(hints[f.name]) in (dict, list))


def column_name(record_type: type, field_name: str) -> str:
    return field_name + "_json" if field_name in _structured(record_type) else field_name


def record_columns(record_type: type, exclude: tuple[str, ...] = ()) -> list[str]:
    """The columns that hold a record type's fields, in field order."""
    return [column_name(record_type, f.name) for f in dataclasses.fields(record_type) if f.name not in exclude]


def record_from_row(record_type: type, row: dict, **fields: Any) -> Any:
    """The record a stored row holds (the inverse of `column_values`); `fields` fill or override fields that
    are stored otherwise (e.g. ItemOutcome.passed)."""
    structured = _structured(record_type)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(record_type):
        column = column_name(record_type, f.name)
        if column in row and row[column] is not None:
            values[f.name] = json.loads(row[column]) if f.name in structured else row[column]
    return record_type(**{**values, **fields})


def column_values(record: Any, exclude: tuple[str, ...] = ()) -> dict[str, Any]:
    """column -> value for one record: each field under its own name, structured fields as JSON."""
    structured = _structured(type(record))
    out: dict[str, Any] = {}
    for f in dataclasses.fields(record):
        if f.name in exclude:
            continue
        value = getattr(record, f.name)
        out[column_name(type(record), f.name)] = canonical_json(value) if f.name in structured else value
    return out
