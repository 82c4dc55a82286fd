"""EvalPlus evaluation: canonical solutions pass, wrong ones fail, extraction and value transport work."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from onecat.gates.tasks import pyvalues
from onecat.gates.tasks.code_extract import code_blocks, extract_code, sanitize
from onecat.gates.tasks.evalplus import OutputComparator, ReferenceCache, check_many, check_solution
from onecat.gates.tasks.evalplus_data import (Problem, chat_messages, chat_response_prefix, completion_prompt,
                                              load_problems)

DATA = Path(os.environ.get("ONECAT_DATA_DIR", "/work/shared/data")) / "evalplus"
HE_FILE, MBPP_FILE = DATA / "HumanEvalPlus-v0.1.10.jsonl.gz", DATA / "MbppPlus-v0.2.0.jsonl.gz"
needs_data = pytest.mark.skipif(not (HE_FILE.is_file() and MBPP_FILE.is_file()),
                                reason="EvalPlus data not found; set ONECAT_DATA_DIR")

# fast subset: includes the tasks with special oracles, float tolerance and deserialized inputs
HE_SUBSET = ["HumanEval/0", "HumanEval/2", "HumanEval/4", "HumanEval/10", "HumanEval/32", "HumanEval/38",
             "HumanEval/53", "HumanEval/87", "HumanEval/120", "HumanEval/163"]
MBPP_SUBSET = ["Mbpp/2", "Mbpp/124", "Mbpp/252", "Mbpp/558", "Mbpp/581", "Mbpp/722", "Mbpp/737", "Mbpp/787",
               "Mbpp/769", "Mbpp/786"]


@pytest.fixture(scope="module")
def problems():
    he = {p.task_id: p for p in load_problems(HE_FILE, "humaneval")}
    mb = {p.task_id: p for p in load_problems(MBPP_FILE, "mbpp")}
    return he, mb


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    root = tmp_path_factory.mktemp("evalplus-cache")
    return {"humaneval": ReferenceCache("he-test", root), "mbpp": ReferenceCache("mbpp-test", root)}


def _as_chat_reply(p: Problem) -> str:
    return f"Here is the solution:\n```python\n{p.reference_code}\n```\nIt passes the tests."


# ----------------------------------------------------------------------------- fidelity
@needs_data
def test_canonical_solutions_pass_on_fixed_subset(problems, cache):
    he, mb = problems
    jobs = {"humaneval": [he[t] for t in HE_SUBSET], "mbpp": [mb[t] for t in MBPP_SUBSET]}
    for name, ps in jobs.items():
        codes = [extract_code(_as_chat_reply(p), p.entry_point, p.prompt) for p in ps]
        assert all(c.has_entry_point for c in codes)
        outcomes = check_many([(p, c.code) for p, c in zip(ps, codes)], cache[name])
        failed = [(o.task_id, o.failure_reason, o.detail) for o in outcomes if not (o.base_pass and o.plus_pass)]
        assert failed == [], failed


@pytest.mark.slow
@needs_data
def test_canonical_solutions_pass_on_all_tasks(tmp_path_factory):
    """Evaluator fidelity over every task of both datasets (expected: 164/164 and 378/378)."""
    root = tmp_path_factory.mktemp("evalplus-full")
    for path, kind in ((HE_FILE, "humaneval"), (MBPP_FILE, "mbpp")):
        ps = load_problems(path, kind)
        start = time.monotonic()
        outcomes = check_many([(p, extract_code(_as_chat_reply(p), p.entry_point, p.prompt).code) for p in ps],
                              ReferenceCache(f"full-{kind}", root))
        failed = [(o.task_id, o.failure_reason, o.detail) for o in outcomes if not o.plus_pass]
        print(f"{kind}: {len(ps) - len(failed)}/{len(ps)} canonical pass in {time.monotonic() - start:.0f}s")
        assert failed == [], failed


# ----------------------------------------------------------------------------- wrong solutions
@needs_data
def test_wrong_solutions_fail_with_reasons(problems, cache):
    he, _ = problems
    p = he["HumanEval/0"]
    ref = cache["humaneval"].get(p)
    body = p.prompt
    cases = {
        "wrong_answer": body + "    return False\n",
        "error": body + "    raise ValueError('nope')\n",
        "timeout": body + "    while True:\n        pass\n",
        "load_error": "def has_close_elements(numbers, threshold):\n    return undefined_name\nimport not_a_module\n",
        "no_code": "",
    }
    for reason, code in cases.items():
        out = check_solution(p, code, ref)
        assert not out.base_pass and not out.plus_pass, reason
        assert out.failure_reason == reason, (reason, out)
    # correct on every base input, wrong on longer plus inputs: base passes, plus fails
    plus_only = (p.prompt + "    if len(numbers) > 8:\n        return True\n"
                 + p.canonical_solution)
    assert max(len(i[0]) for i in p.base_input) <= 8
    out = check_solution(p, plus_only, ref)
    assert out.base_pass and not out.plus_pass and out.failed_set == "plus"


@needs_data
def test_plus_pass_requires_base_pass(problems, cache):
    he, _ = problems
    p = he["HumanEval/4"]
    out = check_solution(p, p.prompt + "    return 0.0\n", cache["humaneval"].get(p))
    assert not out.base_pass and not out.plus_pass and out.failed_set == "base"


@needs_data
def test_forged_results_on_the_channel_do_not_pass(problems, cache):
    """A solution that writes fake 'ok' rows to every descriptor still fails."""
    he, _ = problems
    p = he["HumanEval/0"]
    forge = (
        "import os, json\n"
        "lines = [json.dumps({'event': 'load', 'status': 'ok'})]\n"
        f"lines += [json.dumps({{'set': 'base', 'i': i, 'status': 'ok', 'out': 'PASS'}}) for i in range({len(p.base_input)})]\n"
        "lines += [json.dumps({'event': 'done'})]\n"
        "for fd in range(1, 12):\n"
        "    try:\n        os.write(fd, ('\\n'.join(lines) + '\\n').encode())\n    except OSError:\n        pass\n"
        "os._exit(0)\n"
        "def has_close_elements(numbers, threshold):\n    return True\n")
    out = check_solution(p, forge, cache["humaneval"].get(p))
    assert not out.base_pass and not out.plus_pass


@needs_data
def test_hostile_solution_is_contained(problems, cache):
    he, _ = problems
    p = he["HumanEval/0"]
    hostile = p.prompt + "    import os\n    os.fork()\n    return False\n"
    out = check_solution(p, hostile, cache["humaneval"].get(p))
    assert out.failure_reason == "error" and "disabled" in (out.detail or "")


# ----------------------------------------------------------------------------- comparison rules
def _problem(dataset, entry_point, atol=0.0):
    return Problem("t/1", dataset, "", entry_point, "", [], [], atol)


def test_output_comparison_rules():
    c = OutputComparator(_problem("humaneval", "f"))
    assert c.matches([], [1, 2], [1, 2]) and not c.matches([], (1, 2), [1, 2])
    assert c.matches([], 0.1 + 0.2, 0.3)             # floats: atol 1e-6 once a float is expected
    assert not c.matches([], 0.31, 0.3)
    assert not c.matches([], [1.0, 2.0], (1.0, 2.0))  # type must match under tolerance
    c = OutputComparator(_problem("mbpp", "similar_elements"))
    assert c.matches([], (5, 4), (4, 5))
    c = OutputComparator(_problem("mbpp", "check_str"))
    assert c.matches([], pyvalues.Opaque("re.Match", "<m>"), True) and not c.matches([], None, True)
    c = OutputComparator(_problem("humaneval", "find_zero", atol=1e-4))
    assert c.matches([[-6, 11, -6, 1]], 1.0, 999) and not c.matches([[-6, 11, -6, 1]], 1.5, 999)


def test_value_transport_round_trip():
    values = [None, True, 3, -2 ** 200, 10 ** 5000, 1.5, float("inf"), "s", b"\x00\xff", (1, [2, (3,)]),
              {1: "a", (2, 3): {4}}, {frozenset({1})}, 2 + 3j, [], ()]
    for v in values:
        assert pyvalues.loads(pyvalues.dumps(v)) == v, v
    assert isinstance(pyvalues.loads(pyvalues.dumps(range(3))), pyvalues.Opaque)
    nan = pyvalues.loads(pyvalues.dumps(float("nan")))
    assert nan != nan


def test_builtin_subclasses_cross_as_the_plain_value_they_equal():
    """Counter == dict, namedtuple == tuple, IntEnum == int in Python (and in EvalPlus): so here too."""
    import collections
    import enum

    class Color(enum.IntEnum):
        RED = 1

    class Name(str):
        pass

    point = collections.namedtuple("Point", "x y")
    cases = [(collections.Counter("abca"), {"a": 2, "b": 1, "c": 1}), (collections.OrderedDict(b=1, a=2), {"a": 2, "b": 1}),
             (collections.defaultdict(list, k=[1]), {"k": [1]}), (point(1, 2), (1, 2)), (Color.RED, 1),
             (Name("x"), "x"), ([collections.Counter(a=1)], [{"a": 1}])]
    for fancy, plain in cases:
        assert pyvalues.loads(pyvalues.dumps(fancy)) == plain, fancy
    assert pyvalues.loads(pyvalues.dumps(point(1, 2))) != [1, 2]  # a tuple still is no list
    c = OutputComparator(_problem("humaneval", "histogram"))
    assert c.matches([], pyvalues.loads(pyvalues.dumps(collections.Counter(a=2))), {"a": 2})
    assert not c.matches([], pyvalues.loads(pyvalues.dumps(collections.Counter(a=3))), {"a": 2})


# ----------------------------------------------------------------------------- extraction
def test_extract_from_chat_reply_keeps_needed_code_only():
    reply = ("Sure.\n```python\nimport math\nfrom typing import List\n\nLIMIT = 3\n\n"
             "def helper(x):\n    return math.sqrt(x) + LIMIT\n\ndef unused():\n    return 0\n\n"
             "def solve(xs: List[int]) -> float:\n    return sum(helper(x) for x in xs)\n\n"
             "print(solve([1, 4]))\nassert solve([]) == 0\nif __name__ == '__main__':\n    solve([9])\n```\n")
    ex = extract_code(reply, "solve")
    assert ex.has_entry_point and ex.method == "fenced"
    assert "def helper" in ex.code and "LIMIT = 3" in ex.code and "import math" in ex.code
    assert "unused" not in ex.code and "print(" not in ex.code and "__main__" not in ex.code


def test_extract_truncated_and_body_only_replies():
    truncated = "```python\ndef solve(x):\n    return x + 1\n\ndef other(y):\n    return [y,"
    ex = extract_code(truncated, "solve")
    assert ex.has_entry_point and ex.method == "unclosed_fence" and ex.trimmed_lines > 0
    prompt = 'def solve(x):\n    """Add one."""\n'
    ex = extract_code("```python\n    return x + 1\n```", "solve", prompt)
    assert ex.has_entry_point and ex.method == "fenced+prompt"
    ex = extract_code("    return x + 1\n\nprint(solve(2))\n", "solve", prompt, completion_style=True)
    assert ex.has_entry_point and "print" not in ex.code
    assert not extract_code("I do not know.", "solve").has_entry_point
    assert [b[0] for b in code_blocks("```py\na\n```\ntext\n```\nb\n```")] == ["py", ""]


def test_sanitize_keeps_decorators_and_classes():
    code = ("import functools\nclass Box:\n    pass\n@functools.lru_cache(None)\ndef f(n):\n"
            "    return Box() if n < 0 else n\nx = f(3)\n")
    out, found = sanitize(code, "f")
    assert found and "@functools.lru_cache" in out and "class Box" in out and "x = f(3)" not in out


@needs_data
def test_prompts_follow_evalplus(problems):
    he, mb = problems
    p = he["HumanEval/0"]
    msg = chat_messages(p)[0]["content"]
    assert msg.startswith("Please provide a self-contained Python script") and p.prompt.strip() in msg
    assert chat_response_prefix().endswith("```python\n")
    assert completion_prompt(p) == p.prompt
    assert mb["Mbpp/2"].base_input[0] == [(3, 4, 5, 6), (5, 7, 4, 10)]  # deserialized to tuples


def test_huge_results_cross_as_digests():
    big = [(i, str(i)) for i in range(20_000)]
    enc = pyvalues.decode_value(pyvalues.encode_result(big))
    assert isinstance(enc, pyvalues.Digest) and enc.length == 20_000
    assert enc == pyvalues.decode_value(pyvalues.encode_result(list(big)))
    assert enc != pyvalues.decode_value(pyvalues.encode_result(big[:-1] + [(0, "x")]))
    assert enc != pyvalues.decode_value(pyvalues.encode_result(tuple(big)))  # list vs tuple still differ
    s = "ab" * 60_000
    assert pyvalues.decode_value(pyvalues.encode_result(s)) == pyvalues.decode_value(pyvalues.encode_result("ab" * 60_000))
    floats = [0.5] * 20_000  # floats keep their values (tolerance comparison needs them)
    assert pyvalues.decode_value(pyvalues.encode_result(floats)) == floats
    # equal under == but printed differently (HumanEval/130 returns 2.0 where the reference has 2)
    ints = [1, 3, 2, 8] * 5_000
    as_floats = [1, 3, 2.0, 8.0] * 5_000
    digest = pyvalues.decode_value(pyvalues.encode_result(ints))
    assert digest == pyvalues.decode_value(pyvalues.encode_result(as_floats))
    assert digest == as_floats and digest == ints  # a digest against a list that was not digested
    assert digest != [1, 3, 2.5, 8] * 5_000 and digest != tuple(ints)
    assert pyvalues.decode_value(pyvalues.encode_result([True] * 20_000)) == [1] * 20_000  # True == 1


# ----------------------------------------------------------------------------- result channel protocol
def _judge(expected_base=(1, 2), expected_plus=(3,)):
    from onecat.gates.tasks.evalplus_protocol import CandidateJudge

    expected = {"base": list(expected_base), "plus": list(expected_plus)}
    return CandidateJudge({k: len(v) for k, v in expected.items()}, 4096,
                          lambda name, i, out: out == expected[name][i], lambda name, i, out: f"got {out!r}")


def _feed(judge, *messages) -> bool:
    import json as _json

    more = True
    for m in messages:
        more = judge.on_line(m if isinstance(m, (bytes, type(None))) else _json.dumps(m).encode())
    return more


def _row(name, i, out, status="ok"):
    return {"set": name, "i": i, "status": status, "out": out, "t": 0.001}


def test_protocol_rejects_every_malformed_message():
    from onecat.gates.tasks.evalplus_protocol import PROTOCOL_ERROR

    load = {"event": "load", "status": "ok"}
    bad = [
        b"not json", b"[]", b"[" * 100_000 + b"]" * 100_000, None,  # None: an oversize line
        {"set": [], "i": 0}, {"set": "base", "i": True, "status": "ok", "out": 1, "t": 0},
        {"set": "base", "i": 0, "status": "ok", "out": 1, "t": -1}, {"set": "base", "i": 0, "status": "ok", "out": 1},
        {"set": "base", "i": 0, "status": "ok", "out": 1, "t": 0, "extra": 1},
        {"set": "base", "i": 0, "status": "weird"}, {"set": "base", "i": 0, "status": "error", "error": 5},
        _row("base", 0, {"__tuple__": 5}), _row("base", 0, {"__nope__": 1}), _row("base", 0, {"__set__": [{}]}),
        _row("base", 1, 2), _row("plus", 0, 3), {"event": "done"}, load, {"event": "other"},
    ]
    for message in bad:
        judge = _judge()
        more = _feed(judge, load, message)
        assert not more and judge.failure and judge.failure.reason == PROTOCOL_ERROR, message
    judge = _judge()
    assert not _feed(judge, _row("base", 0, 1)) and judge.failure.reason == PROTOCOL_ERROR  # before load
    judge = _judge()
    assert not _feed(judge, load, _row("base", 0, 1), _row("base", 0, 1))  # duplicate row
    assert judge.failure.reason == PROTOCOL_ERROR


def test_protocol_judges_outputs_in_order_and_stops_at_the_first_failure():
    load = {"event": "load", "status": "ok"}
    judge = _judge()
    assert _feed(judge, load, _row("base", 0, 1), _row("base", 1, 2))
    assert not _feed(judge, _row("plus", 0, 3)) and judge.complete and judge.failure is None
    judge = _judge()
    assert not _feed(judge, load, _row("base", 0, 1), _row("base", 1, 99))
    assert judge.failure.reason == "wrong_answer" and (judge.failure.failed_set, judge.failure.failed_index) == ("base", 1)
    judge = _judge()
    assert not _feed(judge, load, {"set": "base", "i": 0, "status": "error", "error": "boom"})
    assert judge.failure.reason == "error" and judge.failure.detail == "boom"
    judge = _judge()
    assert not _feed(judge, {"event": "load", "status": "timeout"}) and judge.failure.reason == "load_timeout"
