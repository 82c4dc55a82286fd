"""Reasoning split (`<think>...</think>` -> reasoning_content) and Hermes/Qwen tool calls
(`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` -> OpenAI `tool_calls`)."""
from __future__ import annotations

import json
import re
import uuid

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
_TOOL_RE = re.compile(re.escape(TOOL_OPEN) + r"(.*?)(?:" + re.escape(TOOL_CLOSE) + r"|$)", re.S)


def split_reasoning(text: str, starts_in_reasoning: bool) -> tuple[str | None, str]:
    """(reasoning, content). `starts_in_reasoning`: the prompt already opened `<think>` (Qwen3
    templates do), so the output begins inside the reasoning block."""
    body = text
    if not starts_in_reasoning:
        stripped = body.lstrip()
        if not stripped.startswith(THINK_OPEN):
            return None, text
        body = stripped[len(THINK_OPEN):]
    end = body.find(THINK_CLOSE)
    if end < 0:
        return body, ""
    return body[:end], body[end + len(THINK_CLOSE):].lstrip("\n")


def content_before_tools(text: str) -> str:
    """Content up to the first `<tool_call>` (what may be streamed as plain content)."""
    at = text.find(TOOL_OPEN)
    return text if at < 0 else text[:at]


def parse_tool_calls(text: str) -> tuple[str | None, list[dict]]:
    """(remaining content, tool_calls). Blocks that are not valid JSON with a `name` stay as content."""
    calls, kept, last = [], [], 0
    for m in _TOOL_RE.finditer(text):
        try:
            obj = json.loads(m.group(1).strip())
        except json.JSONDecodeError:
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            continue
        args = obj.get("arguments", obj.get("parameters", {}))
        calls.append(make_tool_call(obj["name"], args))
        kept.append(text[last:m.start()])
        last = m.end()
    if not calls:
        return text, []
    kept.append(text[last:])
    content = "".join(kept).strip()
    return content or None, calls


def make_tool_call(name: str, arguments) -> dict:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": args}}


def tools_system_prompt(tools: list[dict]) -> str:
    """Hermes-style tool instructions, for chat templates that do not render `tools` themselves."""
    specs = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ("You may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
            f"{specs}\n</tools>\n\nFor each function call, return a json object with function name and "
            "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')
