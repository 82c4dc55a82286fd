"""Upper bounds on what a contract may ask for, declared once.

A contract is input from anyone: a slip such as `repeats: 1000000000`, or a hostile file, must be
refused when it is checked, not discovered when memory runs out hours into a run. The bounds are
generous for real GPU work. A contract that needs more says so in the file, explicitly, with a
`limits:` block naming the bound it raises, e.g.

    limits: {tokens: 4194304, batch_size: 8192}

The block is part of the contract and of its fingerprint, so the same file validates the same way
in `contract check`, `gate run` and CI.

Each bound names the contract keys it covers: a key is bounded wherever it appears (shared
settings, arm overrides, any workload or gate schema), so a new runner or check whose fields use
these names is covered without further code.

The reader's own limits (file size, nesting depth, number of values, 64-bit integers, seeds) protect
the parser and the store; they cannot be raised from inside the file they protect.
"""
from __future__ import annotations

import math
from typing import Any, Iterator

from pydantic import BaseModel, ConfigDict, Field

MAX_FILE_BYTES = 256 << 10  # a contract is a short settings file (a few KiB); data belongs in `datasets:`
MAX_NESTING = 32  # mappings/lists inside each other; real contracts use about 6
MAX_NODES = 50_000  # keys and values in the whole file; real contracts have a few hundred
INT_MIN, INT_MAX = -(1 << 63), (1 << 63) - 1  # every integer is stored as a signed 64-bit value
SEED_KEYS = ("seed", "seeds")  # 0 <= seed < 2**63: what the engine's generators and the store take


def _bound(default: int, keys: tuple[str, ...], what: str) -> Any:
    return Field(default=default, ge=1, description=what, json_schema_extra={"keys": list(keys)})


class ContractLimits(BaseModel):
    """The size bounds; a contract's `limits:` block overrides any of them by name."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tokens: int = _bound(
        1 << 20, ("input_len", "input_len_max", "output_len", "max_tokens", "segment_len", "shared_prefix_len",
                  "offset_tokens", "max_model_len", "max_num_batched_tokens", "top_k"),
        "tokens in one prompt, one generation, one segment or one model context")
    batch_size: int = _bound(4096, ("batch_sizes", "max_num_seqs", "concurrency", "chunk"),
                             "requests in one batch or in flight at once")
    batch_tokens: int = _bound(1 << 24, (),
                               "prompt tokens built for one batch: the largest batch size (or num_requests) "
                               "times input_len")
    repeats: int = _bound(1000, ("repeats", "reruns", "warmup", "warmup_requests"),
                          "repeats of one measurement, and warm-up rounds")
    segments: int = _bound(100_000, ("segments",), "perplexity segments of one workload")
    requests: int = _bound(100_000, ("num_requests", "num_prompts", "first", "sample"),
                           "requests or items of one workload")
    resamples: int = _bound(1_000_000, ("bootstrap",), "bootstrap resamples of one check")
    speculative_tokens: int = _bound(256, ("num_speculative_tokens", "max_speculative_tokens",
                                           "prompt_lookup_min", "prompt_lookup_max"),
                                     "tokens proposed per speculative step, and n-gram lengths")
    parallel: int = _bound(1024, ("tensor_parallel_size", "pipeline_parallel_size", "eval_workers"),
                           "GPUs or worker processes")
    list_items: int = _bound(10_000, (), "items in any one list (seeds, batch sizes, prompts, workloads, ...)")


DEFAULT_LIMITS = ContractLimits()
KEY_LIMITS: dict[str, str] = {key: name for name, f in ContractLimits.model_fields.items()
                              for key in (f.json_schema_extra or {}).get("keys", [])}


def describe_limits() -> list[tuple[str, int, str, list[str]]]:
    """(name, default, what it bounds, contract keys) for docs and messages."""
    return [(name, f.default, f.description or "", list((f.json_schema_extra or {}).get("keys", [])))
            for name, f in ContractLimits.model_fields.items()]


# --------------------------------------------------------------------------- checking contract data
def size_problems(data: dict, limits: ContractLimits) -> Iterator[tuple[tuple, str]]:
    """(key path, message) for every value in the raw contract data beyond a bound.

    Walks the data as written (before schema validation), so a contract with other errors still
    gets its sizes checked, and keys are found wherever they appear. Iterative: the depth of data
    handed in through the Python API is not bounded by the YAML reader.
    """
    stack: list[tuple[tuple, Any]] = [((k,), v) for k, v in reversed(list(data.items())) if k != "limits"]
    batches: list[tuple[tuple, str]] = []  # reported last: the per-key problems are the direct causes
    while stack:
        path, node = stack.pop()
        if isinstance(node, dict):
            batches += _batch_tokens(path, node, limits)
            stack.extend(((*path, k), v) for k, v in reversed(list(node.items())))
        elif isinstance(node, list):
            if len(node) > limits.list_items:
                yield path, _over(f"{len(node)} items", "list_items", limits.list_items, len(node))
            stack.extend(((*path, i), v) for i, v in reversed(list(enumerate(node))))
        elif isinstance(node, float) and not math.isfinite(node):
            yield path, f"{node} is not a finite number; write a finite value"
        elif isinstance(node, int) and not isinstance(node, bool):
            problem = _int_problem(_key_of(path), node, limits)
            if problem:
                yield path, problem
    yield from batches


def _key_of(path: tuple) -> str | None:
    """The key a value belongs to; list items belong to the list's key (batch_sizes[1] -> batch_sizes)."""
    return next((p for p in reversed(path) if isinstance(p, str)), None)


def _int_problem(key: str | None, value: int, limits: ContractLimits) -> str | None:
    if not INT_MIN <= value <= INT_MAX:
        return f"{value} does not fit in 64 bits ({INT_MIN} .. {INT_MAX})"
    if key in SEED_KEYS and not 0 <= value <= INT_MAX:
        return f"seed {value} is out of range: seeds are integers with 0 <= seed < 2**63"
    name = KEY_LIMITS.get(key or "")
    if name is not None and value > getattr(limits, name):
        return _over(f"{key} {value}", name, getattr(limits, name), value)
    return None


def _batch_tokens(path: tuple, node: dict, limits: ContractLimits) -> list[tuple[tuple, str]]:
    """Prompts are built before they are sent: batch size (or request count) times prompt length must
    fit in memory."""
    length, sizes, requests = node.get("input_len"), node.get("batch_sizes"), node.get("num_requests")
    key = "input_len"
    if _is_int(node.get("input_len_max")):  # drawn lengths go up to it: bound the batch as if all were that long
        length, key = node["input_len_max"], "input_len_max"
    if isinstance(sizes, list):
        count, bound, what = max((b for b in sizes if _is_int(b)), default=None), limits.batch_size, "batch size"
    else:
        count, bound, what = (requests if _is_int(requests) else None), limits.requests, "num_requests"
    if not _is_int(length) or count is None or length > limits.tokens or count > bound:
        return []  # nothing to multiply, or a factor is already refused on its own
    if length * count <= limits.batch_tokens:
        return []
    return [((*path, key), _over(f"{what} {count} x {key} {length} = {length * count} prompt tokens",
                                  "batch_tokens", limits.batch_tokens, length * count))]


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


def _over(what: str, name: str, bound: int, needed: int) -> str:
    about = ContractLimits.model_fields[name].description
    return (f"{what} is above the limit {name}={bound} ({about}); if the contract really needs it, raise the "
            f"bound explicitly in the contract: `limits: {{{name}: {needed}}}`")
