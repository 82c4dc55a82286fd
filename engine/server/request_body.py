"""Request bodies from bytes to validated models, refusing what would break code further in.

`json.loads` alone accepts things no OpenAI client sends and our code cannot handle: NaN and
Infinity, integers of thousands of digits, lone UTF-16 surrogates (valid JSON escapes that are not
Unicode, so the tokenizer and the UTF-8 encoder reject them), and nesting deep enough to exhaust
the recursion limit. Each of those is a 400 here, with the place in the body that holds it. The
checks cost time in proportion to the body (up to --max-request-body-bytes), so handlers run them
on a worker thread.
"""
from __future__ import annotations

import json
import re
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from onecat.engine.server.errors import ApiError

MAX_DEPTH = 64  # OpenAI bodies nest a handful of levels; a JSON schema in a tool or response_format a few dozen
INT_LIMIT = 2**63  # every integer field fits in 64 bits; larger ones in free-form objects are refused too
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


def parse_json(raw: bytes) -> Any:
    """The body as JSON data, or ApiError(400) saying what is wrong with it."""
    try:
        return json.loads(raw, parse_constant=_reject_constant, parse_float=_finite_float)
    except _Refused as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise ApiError(400, f"the request body nests deeper than {MAX_DEPTH} levels") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, an integer of more than 4300 digits
        raise ApiError(400, f"the request body is not valid JSON: {str(exc)[:200]}") from None


def _path(parts: tuple) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else (f".{p}" if i else str(p)) for i, p in enumerate(parts))


def _bad_value(where: tuple, value: Any) -> ApiError:
    field = _path(where) or "the body"
    if isinstance(value, str):
        return ApiError(400, f"{field} holds a lone UTF-16 surrogate (such as \\ud800), which is not a Unicode "
                             "character", param=str(where[0]) if where else None)
    return ApiError(400, f"{field}: the integer {str(value)[:30]} is out of the 64-bit range",
                    param=str(where[0]) if where else None)


def _bad_scalar(value: Any) -> bool:
    kind = type(value)
    return (kind is str and _SURROGATE.search(value) is not None) or \
        (kind is int and not -INT_LIMIT <= value < INT_LIMIT)


def _check_list(node: list, where: tuple, stack: list) -> None:
    kinds = set(map(type, node))
    if kinds <= {int}:  # token ids: checked in C
        if node and (max(node) >= INT_LIMIT or min(node) < -INT_LIMIT):
            bad = next(i for i, v in enumerate(node) if not -INT_LIMIT <= v < INT_LIMIT)
            raise _bad_value(where + (bad,), node[bad])
    elif kinds <= {str}:  # prompts, stop strings
        if _SURROGATE.search("".join(node)):
            bad = next(i for i, v in enumerate(node) if _SURROGATE.search(v))
            raise _bad_value(where + (bad,), node[bad])
    else:
        for i, value in enumerate(node):
            _visit(value, where + (i,), stack)


def _visit(value: Any, at: tuple, stack: list) -> None:
    """One element of a list or object: containers are queued (checked iteratively), scalars checked now."""
    kind = type(value)
    if kind is dict or kind is list:
        if value:
            stack.append((value, at))
    elif _bad_scalar(value):
        raise _bad_value(at, value)


def check_structure(data: dict, fields: set[str] | None = None) -> None:
    """Depth at most MAX_DEPTH, only valid Unicode strings (keys included) and 64-bit integers.
    Iterative, so a deep body cannot exhaust the stack; lists of plain ids or strings are checked
    in C. `fields`: only these top-level fields (the model ignores the rest)."""
    stack: list[tuple[Any, tuple]] = [({k: v for k, v in data.items() if fields is None or k in fields}, ())]
    while stack:
        node, where = stack.pop()
        if len(where) >= MAX_DEPTH:
            raise ApiError(400, f"the request body nests deeper than {MAX_DEPTH} levels (at {_path(where[:4])}...)",
                           param=str(where[0]))
        if type(node) is list:
            _check_list(node, where, stack)
            continue
        for key, value in node.items():
            if _SURROGATE.search(key):
                raise ApiError(400, f"a key in {_path(where) or 'the body'} holds a lone UTF-16 surrogate",
                               param=str(where[0]) if where else None)
            _visit(value, where + (key,), stack)


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


def _field_names(model: type[BaseModel]) -> set[str]:
    return {info.alias or name for name, info in model.model_fields.items()} | set(model.model_fields)


def validate_as(data: Any, model: type[M]) -> M:
    """Parsed JSON -> `model`, every failure an ApiError(400). The types are checked first (in
    pydantic's compiled code, so junk is refused cheaply), then what the model keeps is walked
    for lone surrogates, out-of-range integers and depth."""
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        request = model.model_validate(data)
    except ValidationError as exc:
        msg, param = validation_message(exc.errors())
        raise ApiError(400, msg, param=param) from None
    except RecursionError:
        raise ApiError(400, f"the request body nests deeper than {MAX_DEPTH} levels") from None
    check_structure(data, _field_names(model))
    return request


def parse_request(raw: bytes, model: type[M]) -> M:
    """Bytes -> `model`, every failure an ApiError(400). CPU work in proportion to the body: run it
    on a worker thread."""
    return validate_as(parse_json(raw), model)
