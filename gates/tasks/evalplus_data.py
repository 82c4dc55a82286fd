"""HumanEval+ / MBPP+ problems as EvalPlus ships them, and the prompts EvalPlus builds from them."""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# EvalPlus codegen (evalplus/provider/utility.py): chat models get the task in a bare fence and the
# assistant turn is pre-filled up to an open ```python fence.
INSTRUCTION_PREFIX = ("Please provide a self-contained Python script that solves the following problem "
                      "in a markdown code block:")
RESPONSE_PREFIX = ("Below is a Python script with a self-contained function that solves the problem and "
                   "passes corresponding tests:")


@dataclass
class Problem:
    task_id: str
    dataset: str  # "humaneval" | "mbpp"
    prompt: str
    entry_point: str
    canonical_solution: str
    base_input: list = field(repr=False)
    plus_input: list = field(repr=False)
    atol: float = 0.0

    @property
    def reference_code(self) -> str:
        return self.prompt + self.canonical_solution


def _tuples(x: Any) -> Any:
    return tuple(_tuples(i) for i in x) if isinstance(x, list) else x


def mbpp_deserialize_inputs(task_id: str, inputs: list) -> list:
    """MBPP+ stores tuples/sets/complex as JSON lists/strings; EvalPlus restores them per task."""
    n = int(str(task_id).split("/")[-1])
    if n in (2, 116, 132, 143, 222, 261, 273, 394, 399, 421, 424, 429, 470, 560, 579, 596, 616, 630,
             726, 740, 744, 809):
        return [[tuple(a) for a in inp] for inp in inputs]
    if n in (63, 64, 70, 94, 120, 237, 272, 299, 400, 409, 417, 438, 473, 614, 780):
        return [[[tuple(x) for x in a] for a in inp] for inp in inputs]
    if n in (75, 413, 444, 753):
        return [[[tuple(x) for x in inp[0]]] + [inp[1]] for inp in inputs]
    if n in (106, 750):
        return [[inp[0]] + [tuple(inp[1])] for inp in inputs]
    if n == 115:
        return [[[set(x) if isinstance(x, list) and len(x) else {} for x in inp[0]]] for inp in inputs]
    if n == 124:
        return [(float(inp[0]), complex(inp[1])) for inp in inputs]
    if n in (250, 405, 446, 617, 720, 763, 808):
        return [[tuple(inp[0])] + [inp[1]] for inp in inputs]
    if n in (259, 401, 445):
        return [[tuple(a) for a in [[tuple(x) for x in lst] for lst in inp]] for inp in inputs]
    if n == 278:
        return [[tuple(a) for a in [[tuple(x) if isinstance(x, list) else x for x in inp[0]]]] for inp in inputs]
    if n == 307:
        return [[tuple(inp[0])] + [inp[1], inp[2]] for inp in inputs]
    if n == 722:
        return [[{k: tuple(v) for k, v in inp[0].items()}] + inp[1:] for inp in inputs]
    if n == 252:
        return [[complex(inp[0])] for inp in inputs]
    if n in (580, 615, 791):
        return [_tuples(inp) for inp in inputs]
    return inputs


def parse_problems(text: str, dataset: str) -> list[Problem]:
    if dataset not in ("humaneval", "mbpp"):
        raise ValueError(f"dataset must be 'humaneval' or 'mbpp', got {dataset!r}")
    problems = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        missing = {"task_id", "prompt", "entry_point", "canonical_solution", "base_input", "plus_input"} - set(row)
        if missing:
            raise ValueError(f"line {lineno}: not an EvalPlus record (missing {sorted(missing)}); "
                             "expected HumanEvalPlus/MbppPlus jsonl from the EvalPlus releases")
        base, plus = row["base_input"], row["plus_input"] or []
        if dataset == "mbpp":
            base, plus = mbpp_deserialize_inputs(row["task_id"], base), mbpp_deserialize_inputs(row["task_id"], plus)
        problems.append(Problem(row["task_id"], dataset, row["prompt"], row["entry_point"],
                                row["canonical_solution"], base, plus, float(row.get("atol") or 0.0)))
    return problems


def load_problems(path: str | Path, dataset: str) -> list[Problem]:
    """Problems from an EvalPlus .jsonl or .jsonl.gz file."""
    p = Path(path)
    raw = p.read_bytes()
    if p.suffix == ".gz":
        raw = gzip.decompress(raw)
    return parse_problems(raw.decode("utf-8"), dataset)


def chat_messages(problem: Problem) -> list[dict]:
    content = f"{INSTRUCTION_PREFIX}\n```\n{problem.prompt.strip()}\n```\n"
    return [{"role": "user", "content": content}]


def chat_response_prefix() -> str:
    """What EvalPlus pre-fills in the assistant turn; the model continues inside the fence."""
    return f"{RESPONSE_PREFIX}\n```python\n"


def completion_prompt(problem: Problem) -> str:
    """Base-model style: the raw prompt, continued by the model."""
    return problem.prompt
