"""Structured-output tasks: schemas are valid and replies are judged strictly and leniently."""

from __future__ import annotations

import json

import pytest

from onecat.gates.tasks import structured

GOOD = {
    "person": {"name": "Ada", "age": 36, "email": "ada@example.org"},
    "sentiment": {"label": "negative", "confidence": 0.9},
    "math_answer": {"answer": 391, "explanation": "17 * 23 = 391."},
}


def test_at_least_ten_distinct_tasks():
    assert len(structured.TASKS) >= 10
    assert len(structured.TASKS_BY_ID) == len(structured.TASKS)
    for t in structured.TASKS:
        assert json.dumps(t.schema) in t.prompt()


@pytest.mark.parametrize("task_id", sorted(GOOD))
def test_valid_reply_variants(task_id):
    task = structured.TASKS_BY_ID[task_id]
    value = json.dumps(GOOD[task_id])
    v = structured.check_reply(f"  {value}\n", task)
    assert v.valid and v.strict_valid and v.method == "whole"
    v = structured.check_reply(f"Sure!\n```json\n{value}\n```\n", task)
    assert v.valid and not v.strict_valid and v.method == "fence"
    v = structured.check_reply(f"Here you go: {value} hope it helps", task)
    assert v.valid and not v.strict_valid and v.method == "braces"


def test_invalid_replies_are_recorded_with_reasons():
    task = structured.TASKS_BY_ID["person"]
    v = structured.check_reply('{"name": "Ada", "age": -4, "email": "nope"}', task)
    assert v.parsed and not v.valid and not v.strict_valid
    assert any("age" in e for e in v.errors) and any("email" in e for e in v.errors)
    v = structured.check_reply('{"name": "Ada", "age": 3', task)  # truncated
    assert not v.parsed and not v.valid
    v = structured.check_reply("I cannot do that.", task)
    assert not v.parsed and v.errors == ("no JSON value found in the reply",)
    v = structured.check_reply('{"name": "Ada", "age": 3, "email": "a@b.co", "extra": 1}', task)
    assert not v.valid  # additionalProperties: false
