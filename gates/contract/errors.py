"""Contract problems as located, readable issues: `FILE:LINE: key.path: what is wrong (how to fix)`.

Pydantic's own messages are written for programmers ("Input should be a valid integer"); a
contract author needs to know that `true` is not a number, that `1e8` is a float, and which keys a
section allows. Everything that refuses a contract (the YAML reader, the size limits, the schema)
reports through `ContractIssue` so one run lists every problem with its line.
"""
from __future__ import annotations

import datetime
import types
import typing
from typing import Any, Optional, Union

from pydantic import BaseModel, ValidationError

KeyPath = tuple  # a location in the contract data: keys and list indices, e.g. ("workloads", 0, "input_len")


MAX_SHOWN = 50  # problems printed; a file with thousands of broken keys needs the first ones fixed first


class ContractIssue(BaseModel):
    path: str
    message: str
    line: Optional[int] = None


class ContractError(ValueError):
    """A contract that cannot be used, with every problem found (file, line, key path, fix)."""

    def __init__(self, source: str, issues: list[ContractIssue]):
        self.source, self.issues = source, issues
        super().__init__(self.render())

    def render(self) -> str:
        out = [f"{self.source}: invalid contract ({len(self.issues)} problem{'s' * (len(self.issues) != 1)})"]
        for i in self.issues[:MAX_SHOWN]:
            where = f"{self.source}:{i.line}" if i.line else self.source
            out.append(f"  {where}: {i.path + ': ' if i.path else ''}{i.message}")
        if len(self.issues) > MAX_SHOWN:
            out.append(f"  ... and {len(self.issues) - MAX_SHOWN} more (fix these first)")
        return "\n".join(out)


def format_path(path: KeyPath) -> str:
    out = ""
    for p in path:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out


def line_of(lines: dict[KeyPath, int], path: KeyPath) -> Optional[int]:
    """The line of `path`, or of its nearest enclosing key when it has none (a missing key)."""
    for n in range(len(path), -1, -1):
        if path[:n] in lines:
            return lines[path[:n]]
    return None


def issue_at(path: KeyPath, message: str, lines: dict[KeyPath, int]) -> ContractIssue:
    return ContractIssue(path=format_path(path), message=message, line=line_of(lines, path))


def dedupe(issues: list[ContractIssue]) -> list[ContractIssue]:
    seen, out = set(), []
    for i in issues:
        key = (i.path, i.message)
        if key not in seen:
            seen.add(key)
            out.append(i)
    return out


# --------------------------------------------------------------------------- pydantic errors -> issues
def issues_from_validation(exc: ValidationError, data: Any, lines: dict[KeyPath, int], prefix: KeyPath,
                           schema: Any) -> list[ContractIssue]:
    out = []
    for err in exc.errors():
        path = _data_path(data, prefix + tuple(err["loc"]))
        msg = _type_message(err["type"], err.get("input")) or err["msg"]
        if err["type"] == "extra_forbidden":
            allowed = _allowed_keys(schema, path[len(prefix):-1] if len(path) > len(prefix) else ())
            msg = f"unknown key {path[-1]!r}" + (f"; allowed keys: {', '.join(allowed)}" if allowed else "")
        elif err["type"] == "missing":
            msg = "required key is missing"
        elif err["type"] == "literal_error":
            msg = f"{msg}, got {err.get('input')!r}"
        elif err["type"] == "value_error":
            msg = msg.removeprefix("Value error, ")
        out.append(issue_at(path, msg, lines))
    return out


def _type_message(kind: str, value: Any) -> Optional[str]:
    """Say what the YAML value was and how to write what is expected; None: pydantic's text is fine."""
    if kind == "int_type":
        if isinstance(value, bool):
            return f"expected an integer, got {str(value).lower()} (true/false is not a number)"
        if isinstance(value, float):
            if value.is_integer() and abs(value) < 2 ** 53:
                return f"expected a whole number, got {value!r} (a float): write it in digits, {int(value)}"
            return f"expected a whole number, got {value!r} (a float)"
        if isinstance(value, str):
            return f"expected an integer, got the text {value!r}: write the number unquoted, in digits"
    if kind == "float_type":
        if isinstance(value, bool):
            return f"expected a number, got {str(value).lower()} (true/false is not a number)"
        if isinstance(value, str):
            return f"expected a number, got the text {value!r}: write the number unquoted (e.g. 0.5, 1.0e-4)"
    if kind == "bool_type":
        return f"expected true or false, got {value!r}"
    if kind == "string_type":
        if isinstance(value, (datetime.date, datetime.datetime)):
            return f"expected text, got the date {value}: quote it if it is meant as text"
        if isinstance(value, (bool, int, float)):
            shown = str(value).lower() if isinstance(value, bool) else repr(value)
            return f"expected text, got {shown}: quote it if it is meant as text"
    return None


def _data_path(data: Any, loc: tuple) -> KeyPath:
    """Keep the parts of a pydantic error location that walk the input (drop union-member tags)."""
    path, node = [], data
    for part in loc:
        if isinstance(node, dict) and part in node:
            path.append(part)
            node = node[part]
        elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            path.append(part)
            node = node[part]
        elif isinstance(node, (dict, list)) or node is None:
            if isinstance(part, str) and not part.startswith(("function-", "literal[", "union[")) \
                    and part not in ("str", "int", "bool", "float", "list", "dict", "none"):
                if isinstance(node, dict):
                    path.append(part)  # a missing or unknown key: still name it
            node = None
    return tuple(path)


def _allowed_keys(model: Any, path: KeyPath) -> list[str] | None:
    """Field names of the pydantic model found at `path` under `model` (for unknown-key messages)."""
    for part in path:
        model = _unwrap_model(model, expect_index=isinstance(part, int))
        if model is None:
            return None
        if isinstance(part, int):
            continue
        if isinstance(model, type) and issubclass(model, BaseModel):
            if part not in model.model_fields:
                return sorted(model.model_fields)
            model = model.model_fields[part].annotation
        elif isinstance(model, tuple):  # dict value type
            model = model[1]
    model = _unwrap_model(model, expect_index=False)
    return sorted(model.model_fields) if isinstance(model, type) and issubclass(model, BaseModel) else None


def _unwrap_model(tp: Any, expect_index: bool) -> Any:
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return _unwrap_model(args[0], expect_index) if args else None
    if origin is list and expect_index:
        return typing.get_args(tp)[0]
    if origin is dict:
        return ("dict", typing.get_args(tp)[1])
    return tp
