"""Reading a contract file safely, and remembering the line of every key.

A contract may come from anyone, so the reader refuses, with the file and line, whatever could hang
it, exhaust memory or silently mean something else than it looks like:

* files larger than `limits.MAX_FILE_BYTES`, and bytes that are not UTF-8 (named by offset);
* anchors, aliases and merge keys: an alias "bomb" of a few hundred bytes expands to billions of
  nodes, and a contract never needs them (write the value out);
* nesting deeper than `limits.MAX_NESTING` and more than `limits.MAX_NODES` values (checked
  while composing, before Python recursion runs out or a large file is built);
* numbers that YAML 1.1 reads differently from how they look: `1:30` (base 60), `010` (octal),
  infinities and NaN (no contract setting can use them, and fingerprints are JSON), and integers
  outside 64 bits, which are refused before they are converted (a 5000-digit literal is text, not work).

`1e8` is read as the float it looks like (YAML 1.1 would read it as a string), so an integer
setting written that way is refused as a float, with the digits to write instead.
"""
from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any, NoReturn

import yaml
from yaml.composer import Composer
from yaml.constructor import SafeConstructor
from yaml.resolver import Resolver

from onecat.gates.contract.errors import ContractError, ContractIssue, KeyPath, format_path
from onecat.gates.contract.limits import INT_MAX, INT_MIN, MAX_FILE_BYTES, MAX_NESTING, MAX_NODES

_MERGE_TAG = "tag:yaml.org,2002:merge"
_EXPONENT_FLOAT = re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$")


class _Refused(Exception):
    def __init__(self, mark: Any, message: str):
        self.line = mark.line + 1 if mark is not None else None
        super().__init__(message)


# Events come from libyaml when PyYAML has it (several times faster on large files); composing stays in
# Python so that aliases and nesting are checked node by node, before anything is built.
if getattr(yaml, "__with_libyaml__", False):
    _EVENT_SOURCE: tuple = (yaml.cyaml.CParser,)
else:  # pragma: no cover - PyYAML built without libyaml
    _EVENT_SOURCE = (yaml.reader.Reader, yaml.scanner.Scanner, yaml.parser.Parser)


class _ContractLoader(Composer, *_EVENT_SOURCE, SafeConstructor, Resolver):
    """A safe loader without anchors/aliases, with a nesting bound and plain-looking numbers."""

    def __init__(self, stream: str):
        _EVENT_SOURCE[0].__init__(self, stream)
        for source in _EVENT_SOURCE[1:]:
            source.__init__(self)
        Composer.__init__(self)
        SafeConstructor.__init__(self)
        Resolver.__init__(self)
        self._depth = self._nodes = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None) is not None:
            raise _Refused(event.start_mark, "YAML anchors and aliases are not allowed in contracts "
                                             "(&name / *name): write the value out")
        self._nodes += 1
        if self._nodes > MAX_NODES:
            raise _Refused(event.start_mark, f"more than {MAX_NODES} values; a contract needs a few hundred "
                                             f"(long lists of items belong in a dataset file)")
        nests = isinstance(event, (yaml.SequenceStartEvent, yaml.MappingStartEvent))
        if nests:
            self._depth += 1
            if self._depth > MAX_NESTING:
                raise _Refused(event.start_mark, f"nested more than {MAX_NESTING} levels deep; a contract "
                                                 f"needs far fewer (is a bracket left open?)")
        try:
            return super().compose_node(parent, index)
        finally:
            if nests:
                self._depth -= 1

    def construct_plain_int(self, node: yaml.ScalarNode) -> int:
        text = node.value.replace("_", "")
        body = text.lstrip("+-")
        if ":" in body:
            raise _Refused(node.start_mark, f"{node.value!r} is a YAML 1.1 base 60 number "
                                            f"({SafeConstructor.construct_yaml_int(self, node)}): write the "
                                            f"number in plain digits, or quote it if it is text")
        if len(body) > 66:  # longer than any 64-bit integer in any base YAML allows
            raise _Refused(node.start_mark, f"an integer of {len(body)} digits is too large: contract integers "
                                            f"fit in 64 bits ({INT_MIN} .. {INT_MAX})")
        value = SafeConstructor.construct_yaml_int(self, node)
        if len(body) > 1 and body[0] == "0" and body[1] not in "xXbB":
            raise _Refused(node.start_mark, f"{node.value!r} has a leading zero, which YAML 1.1 reads as octal "
                                            f"({value}): write it without the leading zero, or quote it if it "
                                            f"is text")
        if not INT_MIN <= value <= INT_MAX:
            raise _Refused(node.start_mark, f"{node.value} does not fit in 64 bits: contract integers lie in "
                                            f"{INT_MIN} .. {INT_MAX}")
        return value

    def construct_finite_float(self, node: yaml.ScalarNode) -> float:
        if ":" in node.value:
            raise _Refused(node.start_mark, f"{node.value!r} is a YAML 1.1 base 60 number: write it in plain "
                                            f"decimal, or quote it if it is text")
        value = SafeConstructor.construct_yaml_float(self, node)
        if not math.isfinite(value):
            raise _Refused(node.start_mark, f"{node.value} is not a finite number; contract settings need "
                                            f"finite values (a bound that should not apply is left out)")
        return value


_ContractLoader.add_constructor("tag:yaml.org,2002:int", _ContractLoader.construct_plain_int)
_ContractLoader.add_constructor("tag:yaml.org,2002:float", _ContractLoader.construct_finite_float)
_ContractLoader.add_implicit_resolver("tag:yaml.org,2002:float", _EXPONENT_FLOAT, list("-+0123456789"))


def read_contract_text(path: Path, source: str) -> str:
    """The file as text: bounded in size, UTF-8 (a leading byte-order mark is allowed)."""
    size = path.stat().st_size
    if size > MAX_FILE_BYTES:
        _refuse(source, None, f"the file is {size} bytes, larger than the {MAX_FILE_BYTES} bytes a contract may "
                              f"have: a contract holds settings, data belongs in files named under `datasets:`")
    with path.open("rb") as f:
        raw = f.read(MAX_FILE_BYTES + 1)
    if len(raw) > MAX_FILE_BYTES:
        _refuse(source, None, f"the file is larger than the {MAX_FILE_BYTES} bytes a contract may have")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        column = exc.start - raw.rfind(b"\n", 0, exc.start)
        _refuse(source, line, f"not UTF-8 text: byte 0x{raw[exc.start]:02x} at offset {exc.start} (line {line}, "
                              f"column {column}) is not valid UTF-8; save the contract as UTF-8 (is it a binary "
                              f"file, or Latin-1 text?)")
    return text.removeprefix("\ufeff")


def load_yaml(text: str, source: str) -> tuple[Any, dict[KeyPath, int]]:
    """Parse contract YAML; returns the data and the line (1-based) of every key and list item."""
    loader = None
    try:
        loader = _ContractLoader(text)  # the pure-Python reader already checks characters here
        root = loader.get_single_node()
        lines = _line_map(root, source) if root is not None else {}
        data = loader.construct_document(root) if root is not None else None
    except _Refused as exc:
        _refuse(source, exc.line, str(exc))
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
        line = mark.line + 1 if mark is not None else None
        if line is None and isinstance(getattr(exc, "position", None), int):  # ReaderError: bad characters
            line = text.count("\n", 0, exc.position) + 1
        if "nesting depth" in str(exc):  # libyaml's own bound, met when it scans ahead of the composer
            _refuse(source, line, f"nested more than {MAX_NESTING} levels deep; a contract needs far fewer (is a "
                                  f"bracket left open?)")
        problem = getattr(exc, "problem", None) or str(exc).split("\n")[0]
        _refuse(source, line, f"not valid YAML: {problem}")
    finally:
        if loader is not None:
            loader.dispose()
    return data, lines


def _line_map(root: yaml.Node, source: str) -> dict[KeyPath, int]:
    """Line of every key / list item; refuses duplicate and merge (`<<`) keys. Linear: no aliases."""
    lines: dict[KeyPath, int] = {}
    issues: list[ContractIssue] = []

    def walk(node: yaml.Node, path: KeyPath) -> None:
        lines.setdefault(path, node.start_mark.line + 1)
        if isinstance(node, yaml.MappingNode):
            seen: set = set()
            for k, v in node.value:
                if k.tag == _MERGE_TAG:
                    raise _Refused(k.start_mark, "YAML merge keys (<<) are not allowed in contracts: write the "
                                                 "keys out")
                if not isinstance(k, yaml.ScalarNode):
                    raise _Refused(k.start_mark, "a key must be plain text, not a list or mapping")
                key = k.value
                if key in seen:
                    issues.append(ContractIssue(path=format_path(path + (key,)), line=k.start_mark.line + 1,
                                                message="duplicate key; each key may appear once"))
                seen.add(key)
                lines[path + (key,)] = k.start_mark.line + 1
                walk(v, path + (key,))
        elif isinstance(node, yaml.SequenceNode):
            for i, v in enumerate(node.value):
                walk(v, path + (i,))

    walk(root, ())
    if issues:
        raise ContractError(source, issues)
    return lines


def _refuse(source: str, line: int | None, message: str) -> NoReturn:
    raise ContractError(source, [ContractIssue(path="", line=line, message=message)])
