"""GSM8K prompt building, lm-eval extraction and scoring."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from onecat.gates.tasks import gsm8k

DATA = Path(os.environ.get("ONECAT_DATA_DIR", "/work/shared/data"))


def _item(target="72"):
    return gsm8k.GsmItem("gsm8k/x", "Natalia sold clips...", target)


def test_reference_answer_normalization_follows_lm_eval():
    assert gsm8k.normalize("She has 5 + 3 = 8 left.\n#### 1,000") == "1000"
    assert gsm8k.normalize("$18.") == "18"
    assert gsm8k.normalize("72.00") == "72.00"  # lm-eval does not treat 72.00 as 72


@pytest.mark.parametrize("reply, strict, flexible", [
    ("She sold 48 + 24 = 72 clips.\n#### 72", "72", "72"),
    ("#### 1,234.", "1,234.", "1,234."),
    ("The answer is $18.", "[invalid]", "$18."),
    ("5 apples and 7 pears, so 12", "[invalid]", "12"),
    ("no digits here", "[invalid]", "[invalid]"),
    ("#### -3 and later 5", "-3", "5"),
    ("first #### 4 then #### 9", "4", "9"),
])
def test_strict_and_flexible_extraction(reply, strict, flexible):
    assert gsm8k.extract_strict(reply) == strict
    assert gsm8k.extract_flexible(reply) == flexible


def test_scoring_per_question():
    item = _item("1234")
    s = gsm8k.score("Total: 1000 + 234 = 1,234.\n#### 1,234", item)
    assert s.strict_correct and s.flexible_correct and s.extractable
    s = gsm8k.score("I think it is 1,234 dollars, maybe 1235", item)
    assert not s.strict_correct and not s.flexible_correct and s.extractable
    s = gsm8k.score("The total is $1,234.", item)
    assert not s.strict_correct and s.flexible_correct
    s = gsm8k.score("", item)
    assert not s.extractable and not s.flexible_correct


def test_exemplar_answers_are_consistent():
    """Each CoT exemplar's final answer is the result of its own last computation."""
    assert len(gsm8k.COT_EXEMPLARS) == 8
    for q, cot, answer in gsm8k.COT_EXEMPLARS:
        assert gsm8k.normalize(gsm8k.extract_flexible(cot)) == answer, q
        assert gsm8k.score(f"{cot}\n#### {answer}", _item(answer)).strict_correct


def test_prompt_formats():
    item = _item()
    p8 = gsm8k.completion_prompt(item, 8)
    assert p8.count("Question:") == 9 and p8.endswith(f"Question: {item.question}\nAnswer:")
    assert p8.count("#### ") == 8
    assert gsm8k.completion_prompt(item, 0) == f"Question: {item.question}\nAnswer:"
    with pytest.raises(ValueError, match="n_shot"):
        gsm8k.completion_prompt(item, 9)
    msgs = gsm8k.chat_messages(item)
    assert msgs[0]["role"] == "user" and item.question in msgs[0]["content"] and "####" in msgs[0]["content"]


def test_parse_both_dataset_layouts_and_reject_others():
    items = gsm8k.parse_items('{"question": "q1", "answer": "a\\n#### 5"}\n{"id": "c7", "prompt": "q2", "expected": "1,000"}\n')
    assert [(i.item_id, i.target) for i in items] == [("gsm8k/0", "5"), ("c7", "1000")]
    with pytest.raises(ValueError, match="not a GSM8K record"):
        gsm8k.parse_items('{"text": "x"}\n')


@pytest.mark.skipif(not (DATA / "gsm8k/test.jsonl").is_file(), reason="GSM8K test set not available")
def test_full_test_set_reference_answers_score_correct():
    items = gsm8k.parse_items((DATA / "gsm8k/test.jsonl").read_text())
    assert len(items) == 1319
    rows = (DATA / "gsm8k/test.jsonl").read_text().splitlines()
    import json
    for item, row in zip(items, rows):
        answer = json.loads(row)["answer"]
        s = gsm8k.score(answer, item)  # the reference solution itself, in GSM8K's own format
        assert s.strict_correct and s.flexible_correct, item


def test_packaged_sample_parses_when_installed():
    from onecat.gates.datasets import DatasetError, resolve_dataset

    try:
        ds = resolve_dataset("gsm8k_sample")
    except DatasetError as exc:
        pytest.skip(f"gsm8k_sample not available: {exc}")
    import json
    rows = [json.loads(line) for line in ds.read_text().splitlines() if line.strip()]
    items = gsm8k.parse_items(ds.read_text())
    assert len(items) == 100 and items[0].item_id == rows[0]["id"]
    for item, row in zip(items, rows):
        assert gsm8k.score(f"{row.get('upstream_answer', '')}\n#### {row['expected']}", item).strict_correct
