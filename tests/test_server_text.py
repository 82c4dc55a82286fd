"""Pure text pieces of the server: streaming holdback, reasoning split, tool-call parsing."""
from __future__ import annotations

import json

from onecat.engine.server.parsers import parse_tool_calls, split_reasoning
from onecat.engine.server.streaming import DeltaTracker, holdback_len


def test_holdback_keeps_partial_markers_and_incomplete_characters():
    assert holdback_len("Hello wor", ["world!"]) == 3
    assert holdback_len("Hello", ["world"]) == 0
    assert holdback_len("caf\ufffd", []) == 1
    assert holdback_len("a <tool_ca", ["<tool_call>"]) == 8


def test_delta_tracker_never_takes_text_back():
    t = DeltaTracker(["STOP"])
    pieces = [t.delta(s, False) for s in ["Hel", "Hello S", "Hello ST", "Hello world"]]
    assert pieces[:3] == ["Hel", "lo ", ""]
    assert "".join(pieces) == "Hello world"
    assert t.delta("Hello world", True) == ""


def test_reasoning_split():
    assert split_reasoning("<think>plan</think>\nanswer", False) == ("plan", "answer")
    assert split_reasoning("plain answer", False) == (None, "plain answer")
    assert split_reasoning("still thinking", True) == ("still thinking", "")
    assert split_reasoning("why</think>so", True) == ("why", "so")


def test_hermes_tool_calls():
    text = 'Sure.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>\n' \
           '<tool_call>{"name": "g", "arguments": {}}</tool_call>'
    content, calls = parse_tool_calls(text)
    assert content == "Sure."
    assert [c["function"]["name"] for c in calls] == ["f", "g"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"x": 1}
    assert parse_tool_calls("<tool_call>not json</tool_call>") == ("<tool_call>not json</tool_call>", [])
