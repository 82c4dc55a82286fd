"""Quality-task runners driven by an engine that returns canned replies (test inputs, not results):
correct replies must score 100%, garbage 0%, and every generation's health must be recorded."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable, Optional

import pytest

from onecat.engine.outputs import RequestOutput
from onecat.gates.contract import SamplingSpec
from onecat.gates.datasets import resolve_dataset
from onecat.gates.registry import RUNNERS, load_plugins
from onecat.gates.tasks import evalplus_data, gsm8k, structured

DATA = Path(os.environ.get("ONECAT_DATA_DIR", "/work/shared/data"))
needs_data = pytest.mark.skipif(not (DATA / "gsm8k/test.jsonl").is_file(), reason="set ONECAT_DATA_DIR to the data")


@pytest.fixture(autouse=True)
def _data(monkeypatch):
    monkeypatch.setenv("ONECAT_DATA_DIR", str(DATA))  # EvalPlus's reference outputs: conftest's ONECAT_CACHE_DIR


class CharTokenizer:
    eos_token_ids = [0]

    def __init__(self, chat_template: Optional[str] = None):
        self.chat_template = chat_template

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) % 5000 + 1 for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i - 1) for i in ids)

    def apply_chat_template(self, messages, add_generation_prompt=True, **kw) -> str:
        body = "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages)
        return body + ("<|assistant|>\n" if add_generation_prompt else "")


class CannedEngine:
    """Replies with reply_for(prompt_text); records every call so tests can check what was sent."""

    def __init__(self, reply_for: Callable[[str], str], chat_template: Optional[str] = None,
                 finish_reason: str = "stop"):
        self.reply_for, self.finish_reason = reply_for, finish_reason
        self.tokenizer = CharTokenizer(chat_template)
        self.calls: list[tuple[str, list, list]] = []

    def _out(self, text_prompt: str, params) -> RequestOutput:
        reply = self.reply_for(text_prompt)
        ids = self.tokenizer.encode(reply)
        return RequestOutput(request_id="r", prompt=text_prompt, prompt_token_ids=self.tokenizer.encode(text_prompt),
                             token_ids=ids, text=reply, finish_reason=self.finish_reason)

    def generate(self, prompts, params):
        self.calls.append(("generate", prompts, params))
        return [self._out(p, sp) for p, sp in zip(prompts, params)]

    def chat(self, conversations, params):
        self.calls.append(("chat", conversations, params))
        return [self._out("\n".join(m["content"] for m in conv), sp) for conv, sp in zip(conversations, params)]

    def info(self) -> dict:
        return {"engine": "canned", "device": "cpu"}

    def close(self) -> None:
        pass


class MemorySink:
    arm, workload_id = "baseline", "w"

    def __init__(self):
        self.requests, self.items, self.metrics, self.progress = [], [], [], 0
        self.done: set[str] = set()

    def dataset(self, name):
        return resolve_dataset(name)

    def is_done(self, key):
        return key in self.done

    def request(self, record):
        self.requests.append(record)
        self.done.add(record.request_key)

    def item(self, outcome, request_key=None):
        self.items.append(outcome)

    def metric(self, metric):
        self.metrics.append(metric)

    def advance(self, n=1):
        self.progress += n


def _run(kind: str, engine, sampling: Optional[SamplingSpec] = None, seeds=(0,), sink=None, **workload):
    load_plugins()
    runner = RUNNERS[kind]()
    w = runner.Workload(kind=kind, **workload)
    sink = sink or MemorySink()
    sampling = sampling or SamplingSpec(max_tokens=64)
    for unit in runner.plan(w, sampling, list(seeds)):
        runner.run_unit(engine, w, sampling, unit, sink)
    return sink


def _rate(sink, measure):
    return sum(o.passed[measure] for o in sink.items) / len(sink.items)


def _garbage(_prompt: str) -> str:
    return "I am not sure what you mean."


# ----------------------------------------------------------------------------- gsm8k
@pytest.fixture(scope="module")
def gsm_items():
    return gsm8k.parse_items((DATA / "gsm8k/test.jsonl").read_text()) if (DATA / "gsm8k/test.jsonl").is_file() else []


def _gsm_answer_for(items, style: str = "hash"):
    def reply(prompt: str) -> str:
        item = max(items[:40], key=lambda it: prompt.rfind(it.question))
        return f"Step by step we get {item.target}.\n#### {item.target}" if style == "hash" else \
            f"So the total is ${item.target}."
    return reply


@needs_data
def test_gsm8k_chat_correct_and_garbage(gsm_items):
    sink = _run("gsm8k", CannedEngine(_gsm_answer_for(gsm_items)), subset={"first": 12})
    assert len(sink.items) == 12 and _rate(sink, "strict_match") == 1.0 and _rate(sink, "flexible_extract") == 1.0
    assert all(r.natural_stop and not r.capped and r.token_sha256 for r in sink.requests)
    assert sink.metrics[0].name == "task_items" and sink.metrics[0].tags["items"] == 12
    assert sink.metrics[0].tags["dataset_sha256"] == resolve_dataset("gsm8k").sha256

    sink = _run("gsm8k", CannedEngine(_garbage), subset={"first": 12})
    assert _rate(sink, "strict_match") == 0.0 and _rate(sink, "flexible_extract") == 0.0
    assert {o.failure_reason for o in sink.items} == {"no_answer"}


@needs_data
def test_gsm8k_completion_format_and_flexible_only(gsm_items):
    engine = CannedEngine(_gsm_answer_for(gsm_items, style="dollar"))
    sink = _run("gsm8k", engine, subset={"ids": ["gsm8k/3", "gsm8k/7"]}, format="completion", n_shot=8)
    kind, prompts, params = engine.calls[0]
    assert kind == "generate" and prompts[0].count("Question:") == 9
    assert "Question:" in params[0].stop
    assert [o.item_id for o in sink.items] == ["gsm8k/3", "gsm8k/7"]
    assert _rate(sink, "flexible_extract") == 1.0 and _rate(sink, "strict_match") == 0.0


@needs_data
def test_gsm8k_capped_reply_records_extractable_answer(gsm_items):
    sink = _run("gsm8k", CannedEngine(_gsm_answer_for(gsm_items), finish_reason="length"), subset={"first": 3})
    assert all(r.capped and not r.natural_stop for r in sink.requests)
    assert all(r.extra["capped_with_answer"] for r in sink.requests)
    sink = _run("gsm8k", CannedEngine(_garbage, finish_reason="length"), subset={"first": 3})
    assert {o.failure_reason for o in sink.items} == {"capped_no_answer"}


@needs_data
def test_gsm8k_seeded_sample_and_resume(gsm_items):
    sink = _run("gsm8k", CannedEngine(_gsm_answer_for(gsm_items)), subset={"sample": 5, "seed": 3}, seeds=(0, 1))
    ids = [o.item_id for o in sink.items]
    assert len(ids) == 10 and ids[:5] == ids[5:]
    again = _run("gsm8k", CannedEngine(_gsm_answer_for(gsm_items)), subset={"sample": 5, "seed": 3})
    assert [o.item_id for o in again.items] == ids[:5]
    engine = CannedEngine(_gsm_answer_for(gsm_items))
    _run("gsm8k", engine, subset={"sample": 5, "seed": 3}, sink=again)  # everything already done
    assert engine.calls == []


def test_gsm8k_subset_rules_are_validated():
    load_plugins()
    with pytest.raises(ValueError, match="one of first / ids / sample"):
        RUNNERS["gsm8k"].Workload(kind="gsm8k", subset={"first": 3, "sample": 2})


# ----------------------------------------------------------------------------- evalplus
def _canonical_reply(problems, completion=False, prefilled=False):
    def reply(prompt: str) -> str:
        p = next(p for p in problems if p.prompt.strip() in prompt)
        if completion:
            return p.canonical_solution
        if prefilled:  # the model continues inside the pre-filled ```python fence
            return p.reference_code + "\n```\n"
        return f"Certainly!\n```python\n{p.reference_code}\n```\n"
    return reply


@needs_data
@pytest.mark.parametrize("kind, dataset, ids", [
    ("humaneval_plus", "humaneval_plus", ["HumanEval/0", "HumanEval/2", "HumanEval/32", "HumanEval/38", "HumanEval/53"]),
    ("mbpp_plus", "mbpp_plus", ["Mbpp/2", "Mbpp/124", "Mbpp/581", "Mbpp/737", "Mbpp/786"]),
])
def test_evalplus_canonical_replies_score_100_and_garbage_0(kind, dataset, ids):
    ds = resolve_dataset(dataset)
    problems = evalplus_data.parse_problems(ds.read_text(), "humaneval" if kind == "humaneval_plus" else "mbpp")
    engine = CannedEngine(_canonical_reply(problems))
    sink = _run(kind, engine, subset={"ids": ids}, eval_workers=2)
    assert engine.calls[0][0] == "chat"  # no chat template -> plain chat, no pre-fill
    assert [o.item_id for o in sink.items] == ids
    assert _rate(sink, "base") == 1.0 and _rate(sink, "plus") == 1.0, [o.extra["detail"] for o in sink.items]
    assert all(r.extra["has_entry_point"] and r.extra["code_method"] == "fenced" for r in sink.requests)
    assert any(m.name == "sandbox_eval_s_per_task" for m in sink.metrics)

    sink = _run(kind, CannedEngine(_garbage), subset={"ids": ids})
    assert _rate(sink, "base") == 0.0 and _rate(sink, "plus") == 0.0
    assert {o.failure_reason for o in sink.items} == {"no_code"}


@needs_data
def test_evalplus_prefill_and_completion_styles():
    ds = resolve_dataset("humaneval_plus")
    problems = evalplus_data.parse_problems(ds.read_text(), "humaneval")
    ids = ["HumanEval/1", "HumanEval/10"]
    engine = CannedEngine(_canonical_reply(problems, prefilled=True), chat_template="{{ messages }}")
    sink = _run("humaneval_plus", engine, subset={"ids": ids})
    kind, prompts, _ = engine.calls[0]
    assert kind == "generate" and prompts[0].endswith(evalplus_data.chat_response_prefix())
    assert _rate(sink, "plus") == 1.0 and {r.extra["prompt_mode"] for r in sink.requests} == {"chat_prefill"}

    engine = CannedEngine(_canonical_reply(problems, completion=True))
    sink = _run("humaneval_plus", engine, subset={"ids": ids}, style="completion")
    kind, prompts, params = engine.calls[0]
    assert kind == "generate" and prompts[0] == problems[1].prompt and "\nif __name__" in params[0].stop
    assert _rate(sink, "plus") == 1.0


@needs_data
def test_evalplus_wrong_code_fails_with_reason():
    ds = resolve_dataset("humaneval_plus")
    problems = evalplus_data.parse_problems(ds.read_text(), "humaneval")
    p0 = problems[0]
    engine = CannedEngine(lambda _: f"```python\n{p0.prompt}    return True\n```")
    sink = _run("humaneval_plus", engine, subset={"first": 1})
    o = sink.items[0]
    assert not o.passed["base"] and o.failure_reason == "wrong_answer" and o.extra["failed_set"] == "base"


# ----------------------------------------------------------------------------- structured output
def _valid_json_for(prompt: str) -> str:
    samples = {
        "person": {"name": "Ada", "age": 36, "email": "ada@example.org"},
        "weather": {"city": "Paris", "temperature_c": 18.5, "condition": "cloudy", "wind_kmh": 12},
        "shopping_list": {"items": [{"name": "flour", "quantity": 1}, {"name": "eggs", "quantity": 3},
                                    {"name": "milk", "quantity": 1}]},
        "book": {"title": "Dune", "author": "Frank Herbert", "year": 1965, "genres": ["science fiction"]},
        "sentiment": {"label": "negative", "confidence": 0.93},
        "calendar_event": {"title": "Team sync", "date": "2026-12-07", "start": "10:00", "duration_min": 30,
                           "attendees": ["ana", "bo"]},
        "math_answer": {"answer": 391, "explanation": "17 times 23 is 391."},
        "address": {"company": "Acme GmbH", "street": "Hauptstr. 1", "city": "Berlin", "postal_code": "10115",
                    "country_code": "DE"},
        "recipe": {"name": "Tea", "minutes": 5, "steps": [{"order": 1, "text": "Boil water"},
                                                          {"order": 2, "text": "Steep the leaves"}]},
        "entities": {"people": ["Ada Lovelace", "Charles Babbage"], "places": ["London"]},
        "product": {"id": "SKU-123", "name": "Mug", "price_eur": 9.5, "in_stock": True},
    }
    task = next(t for t in structured.TASKS if t.instruction in prompt)
    return json.dumps(samples[task.task_id])


def test_structured_output_valid_and_garbage():
    sink = _run("structured_output", CannedEngine(_valid_json_for))
    assert len(sink.items) == len(structured.TASKS)
    assert _rate(sink, "valid") == 1.0 and _rate(sink, "strict_valid") == 1.0
    sink = _run("structured_output", CannedEngine(_garbage), tasks=["person", "book"])
    assert _rate(sink, "valid") == 0.0 and {o.failure_reason for o in sink.items} == {"no_json"}
    with pytest.raises(ValueError, match="unknown structured tasks"):
        RUNNERS["structured_output"].Workload(kind="structured_output", tasks=["nope"])


# ----------------------------------------------------------------------------- through the gate
GATE_CONTRACT = """
name: quality-canned
model: {source: "fake:canned"}
engine: {backend: fake}
sampling: {temperature: 0.0, max_tokens: 64}
seeds: [0]
workloads:
  - {kind: gsm8k, subset: {first: 8}}
  - {kind: humaneval_plus, subset: {ids: ["HumanEval/0", "HumanEval/2"]}}
  - {kind: mbpp_plus, subset: {ids: ["Mbpp/2", "Mbpp/581"]}}
  - {kind: structured_output, tasks: [person, sentiment]}
gates:
  - {check: task_score, workload: gsm8k, margin: 0.0}
  - {check: task_score, workload: humaneval_plus, margin: 0.0}
  - {check: task_score, workload: mbpp_plus, margin: 0.0}
  - {check: task_score, workload: structured_output, margin: 0.0}
"""


@needs_data
@pytest.mark.parametrize("candidate_garbage, decision", [(False, "PROMOTE"), (True, "ROLLBACK")])
def test_quality_workloads_through_gate_run(tmp_path, gsm_items, candidate_garbage, decision):
    import gate_fakes  # noqa: F401  registers the "fake" backend the contract names (tests/ is on sys.path)
    from onecat.gates.gate_run import run_gate

    he = evalplus_data.parse_problems(resolve_dataset("humaneval_plus").read_text(), "humaneval")
    mb = evalplus_data.parse_problems(resolve_dataset("mbpp_plus").read_text(), "mbpp")
    code_reply, gsm_reply = _canonical_reply(he + mb), _gsm_answer_for(gsm_items)

    def good(prompt: str) -> str:
        if "JSON Schema" in prompt:
            return _valid_json_for(prompt)
        if "self-contained Python script" in prompt:
            return code_reply(prompt)
        return gsm_reply(prompt)

    def opener(arm, seed):
        return CannedEngine(_garbage if (candidate_garbage and arm.name == "candidate") else good)

    contract = tmp_path / "quality.yaml"
    contract.write_text(GATE_CONTRACT)
    outcome = run_gate(contract, tmp_path / "r.duckdb", report_dir=tmp_path, open_engine=opener)
    assert outcome.verdict.decision == decision, [(g, r) for g, r in outcome.results]


# ----------------------------------------------------------------------------- determinism
def test_determinism_records_each_steps_top_logprobs_when_asked():
    """top_logprobs: 2 asks the engine for logprobs and stores the tokens and each step's logprobs, likeliest
    first (token_hash_equal's near-tie rule reads them); without it nothing extra is stored."""
    from onecat.engine import LLM

    with LLM("embedded:smollm2-135m-instruct", max_model_len=256) as llm:
        sink = _run("determinism", llm, SamplingSpec(max_tokens=6), num_prompts=1, reruns=1,
                    batch_invariance=False, top_logprobs=2)
        plain = _run("determinism", llm, SamplingSpec(max_tokens=6), num_prompts=1, reruns=1,
                     batch_invariance=False)
    (rec,), (bare,) = sink.requests, plain.requests
    steps = rec.extra["step_logprobs"]
    assert rec.extra["token_ids"] and len(steps) == len(rec.extra["token_ids"])
    for tok, step in zip(rec.extra["token_ids"], steps):
        assert len(step) >= 2 and step[0][0] == tok and step[0][1] >= step[1][1]  # greedy: the choice leads
    assert "step_logprobs" not in bare.extra and bare.token_sha256 == rec.token_sha256
