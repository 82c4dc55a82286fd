"""Request bodies from bytes to validated models, refusing what would break code further in.

`json.loads` alone accepts things no OpenAI client sends and our code cannot handle: NaN and
Infinity, integers of thousands of digits, lone UTF-16 surrogates (valid JSON escapes that are not
Unicode, so the tokenizer and the UTF-8 encoder reject them), and nesting deep enough to exhaust
the recursion limit. Each of those is a 400 here, with the place in the body that holds it.
"""
from __future__ import annotations

import json
import re
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from onecat.engine.server.errors import ApiError

MAX_DEPTH = 64  # OpenAI bodies nest a handful of levels; a JSON schema in a tool or response_format a few dozen
MAX_INT_DIGITS = 19  # every integer field fits in 64 bits
_SURROGATE = re.compile("[\ud800-\udfff]")
M = TypeVar("M", bound=BaseModel)


class _Refused(ValueError):
    pass


def _reject_constant(name: str) -> Any:
    raise _Refused(f"{name} is not a JSON number; send a finite number")


def _finite_float(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise _Refused(f"the number {text[:40]} is out of the floating-point range")
    return value


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise _Refused(f"an integer with {len(text.lstrip('-'))} digits is out of range (at most "
                       f"{MAX_INT_DIGITS} digits)")
    return int(text)


def _path(parts: tuple) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else (f".{p}" if i else str(p)) for i, p in enumerate(parts))


def check_structure(data: Any) -> None:
    """Depth at most MAX_DEPTH and only valid Unicode strings (keys included); iterative, so a deep
    body cannot exhaust the stack here either."""
    stack: list[tuple[Any, tuple]] = [(data, ())]
    while stack:
        node, where = stack.pop()
        if len(where) > MAX_DEPTH:
            raise ApiError(400, f"the request body nests deeper than {MAX_DEPTH} levels (at {_path(where[:4])}...)")
        if isinstance(node, str):
            if _SURROGATE.search(node):
                raise ApiError(400, f"{_path(where) or 'the body'} holds a lone UTF-16 surrogate (such as "
                                    r"\ud800), which is not a Unicode character", param=_param(where))
        elif isinstance(node, dict):
            for key, value in node.items():
                if _SURROGATE.search(key):
                    raise ApiError(400, f"a key in {_path(where) or 'the body'} holds a lone UTF-16 surrogate",
                                   param=_param(where))
                stack.append((value, where + (key,)))
        elif isinstance(node, list):
            stack.extend((value, where + (i,)) for i, value in enumerate(node))


def _param(where: tuple) -> str | None:
    return str(where[0]) if where else None


def parse_json(raw: bytes) -> Any:
    """The body as JSON data, or ApiError(400) saying what is wrong with it."""
    try:
        data = json.loads(raw, parse_constant=_reject_constant, parse_float=_finite_float, parse_int=_bounded_int)
    except _Refused as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise ApiError(400, f"the request body nests deeper than {MAX_DEPTH} levels") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
        raise ApiError(400, f"the request body is not valid JSON: {exc}") from None
    check_structure(data)
    return data


def validation_message(errors: list) -> tuple[str, str | None]:
    """pydantic's errors as one readable line, and the top-level field they are about."""
    parts, param = [], None
    for e in errors[:5]:
        loc = [str(x) for x in e.get("loc", ()) if x != "body"]
        if e.get("type") == "json_invalid":
            return f"the request body is not valid JSON: {e.get('msg')}", None
        param = param or (loc[0] if loc else None)
        parts.append(f"{'.'.join(loc) or 'body'}: {e.get('msg')}")
    return "invalid request: " + "; ".join(parts), param


def validate_as(data: Any, model: type[M]) -> M:
    """Parsed JSON -> `model`, every failure an ApiError(400)."""
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        msg, param = validation_message(exc.errors())
        raise ApiError(400, msg, param=param) from None
    except RecursionError:  # a validator recursing on a (depth-checked) body: still the body's fault
        raise ApiError(400, "the request body is too deeply nested to validate") from None


def parse_request(raw: bytes, model: type[M]) -> M:
    """Bytes -> `model`, every failure an ApiError(400)."""
    return validate_as(parse_json(raw), model)
