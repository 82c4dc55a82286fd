"""Chat messages and tools -> the prompt text the model's chat template renders.

Messages arrive validated (protocol.ChatMessage); what is left to check here is what the template
needs: text-only content, assistant `tool_calls` rendered back into the Hermes text form for
templates that do not render them, and the Hermes tool instructions for templates that do not
render `tools`. Runs on a worker thread (cpu_work.py): templates are Python and can be slow.
"""
from __future__ import annotations

import json
from typing import Any

from onecat.engine.server.errors import ApiError
from onecat.engine.server.parsers import TOOL_CLOSE, TOOL_OPEN, tools_system_prompt
from onecat.engine.server.protocol import ChatMessage, NamedToolChoice, ToolSpec


def text_of(content: Any, k: int) -> str:
    """A message's content as one string: a string, or a list of text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        if isinstance(part, str):
            parts.append(part)
        elif isinstance(part, dict) and part.get("type") in ("text", "input_text"):
            text = part.get("text", "")
            if not isinstance(text, str):
                raise ApiError(400, f"messages[{k}].content: a text part's `text` must be a string", param="messages")
            parts.append(text)
        else:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ApiError(400, f"messages[{k}].content: a part of type {kind!r} is not supported; send text parts "
                                '({"type": "text", "text": "..."})', param="messages")
    return "".join(parts)


def tool_dicts(tools: list[ToolSpec] | None) -> list[dict] | None:
    return [t.model_dump(exclude_none=True) for t in tools] if tools else None


def _tool_call_text(calls: list[dict]) -> str:
    blocks = []
    for c in calls:
        fn = c["function"]
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                pass
        blocks.append(f"{TOOL_OPEN}\n" + json.dumps({"name": fn["name"], "arguments": args}, ensure_ascii=False)
                      + f"\n{TOOL_CLOSE}")
    return "\n".join(blocks)


def messages_for_template(template: str, messages: list[ChatMessage], tools: list[dict] | None) -> list[dict]:
    renders_tool_calls = "tool_calls" in template
    msgs = []
    for k, m in enumerate(messages):
        msg = m.model_dump(exclude_unset=True)
        msg["role"] = "system" if m.role == "developer" else m.role
        msg["content"] = text_of(m.content, k)
        calls = msg.get("tool_calls")
        if calls and not renders_tool_calls:
            msg["content"] = (msg["content"] + "\n" if msg["content"] else "") + _tool_call_text(calls)
            msg.pop("tool_calls", None)
        msgs.append(msg)
    if tools and "tools" not in template:
        prompt = tools_system_prompt(tools)
        if msgs and msgs[0]["role"] == "system":
            msgs[0] = {**msgs[0], "content": msgs[0]["content"] + "\n\n" + prompt}
        else:
            msgs.insert(0, {"role": "system", "content": prompt})
    return msgs


def render_prompt(tokenizer: Any, messages: list[ChatMessage], tools: list[dict] | None, *,
                  add_generation_prompt: bool, template_kwargs: dict | None) -> str:
    """The prompt text; a template that refuses the messages is the caller's 400."""
    template = tokenizer.chat_template or ""
    if not template:
        raise ApiError(400, "this model has no chat template; use /v1/completions with a plain prompt",
                       param="messages")
    msgs = messages_for_template(template, messages, tools)
    template_tools = tools if tools and "tools" in template else None
    try:
        return tokenizer.apply_chat_template(msgs, add_generation_prompt=add_generation_prompt,
                                             tools=template_tools, **(template_kwargs or {}))
    except Exception as exc:  # noqa: BLE001 - template errors are the caller's messages
        raise ApiError(400, f"the chat template could not render these messages: {type(exc).__name__}: {exc}",
                       param="messages") from None


# --------------------------------------------------------------------------- tool choice
def tool_mode(tools: list[dict] | None, choice: Any) -> tuple[str, dict | None]:
    """('none' | 'auto' | 'required' | 'named', the named function's spec)."""
    if not tools:
        if choice not in (None, "none", "auto"):
            raise ApiError(400, "tool_choice needs `tools`", param="tool_choice")
        return "none", None
    if choice is None or choice == "auto":
        return "auto", None
    if choice in ("none", "required"):
        return choice, None
    name = choice.function.name if isinstance(choice, NamedToolChoice) else None
    for t in tools:
        if t["function"]["name"] == name:
            return "named", t["function"]
    raise ApiError(400, f"tool_choice names function {name!r}, which is not in `tools`", param="tool_choice")


def tool_schema(mode: str, named: dict | None, tools: list[dict]) -> Any:
    """The JSON schema that forces a call (vLLM does the same), or None."""
    if mode == "named":
        return named.get("parameters") or {"type": "object"}
    if mode == "required":
        alts = [{"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                                  "parameters": t["function"].get("parameters") or {"type": "object"}},
                 "required": ["name", "parameters"]} for t in tools]
        return {"type": "array", "minItems": 1, "items": {"anyOf": alts}}
    return None
