"""Python values <-> tagged JSON, so test inputs and outputs cross the sandbox boundary as data.

Pickle would let a sandboxed program run code in the harness when its output is read back; this
encoding can only ever produce plain values. Tuples, sets, dicts with any keys, complex, bytes and
huge ints survive the round trip; anything else becomes an `Opaque` (type name + repr) that equals
only an Opaque with the same type and repr. Stdlib only: the sandbox driver embeds this source.
"""

import json
import math

_BIG_INT_DIGITS = 4000  # decimal conversion of larger ints is refused by CPython's default limit


class Opaque:
    """A value that could not be encoded (e.g. a re.Match); compared by type name and repr."""

    __slots__ = ("type_name", "text")

    def __init__(self, type_name, text):
        self.type_name = type_name
        self.text = text

    def __eq__(self, other):
        return isinstance(other, Opaque) and (self.type_name, self.text) == (other.type_name, other.text)

    def __hash__(self):
        return hash((self.type_name, self.text))

    def __repr__(self):
        return f"<{self.type_name} {self.text}>"


def encode_value(value, _depth=0):
    if _depth > 200:
        raise ValueError("value nested too deeply to encode")
    kind = type(value)
    if value is None or kind is bool or kind is str:
        return value
    if kind is int:
        if value.bit_length() > _BIG_INT_DIGITS * 3:
            return {"__int__": hex(value)}
        return value
    if kind is float:
        if math.isfinite(value):
            return value
        return {"__float__": repr(value)}
    d = _depth + 1
    if kind is list:
        return [encode_value(v, d) for v in value]
    if kind is tuple:
        return {"__tuple__": [encode_value(v, d) for v in value]}
    if kind is dict:
        return {"__dict__": [[encode_value(k, d), encode_value(v, d)] for k, v in value.items()]}
    if kind is set or kind is frozenset:
        return {"__set__" if kind is set else "__frozenset__": [encode_value(v, d) for v in value]}
    if kind is complex:
        return {"__complex__": [encode_value(value.real, d), encode_value(value.imag, d)]}
    if kind is bytes:
        return {"__bytes__": value.hex()}
    if isinstance(value, Opaque):
        return {"__opaque__": value.type_name, "repr": value.text}
    try:
        text = repr(value)[:2000]
    except BaseException:
        text = "<unrepresentable>"
    return {"__opaque__": f"{kind.__module__}.{kind.__qualname__}", "repr": text}


def decode_value(data):
    if isinstance(data, list):
        return [decode_value(v) for v in data]
    if not isinstance(data, dict):
        return data
    if "__tuple__" in data:
        return tuple(decode_value(v) for v in data["__tuple__"])
    if "__dict__" in data:
        return {_hashable(decode_value(k)): decode_value(v) for k, v in data["__dict__"]}
    if "__set__" in data:
        return {_hashable(decode_value(v)) for v in data["__set__"]}
    if "__frozenset__" in data:
        return frozenset(_hashable(decode_value(v)) for v in data["__frozenset__"])
    if "__complex__" in data:
        re_, im = data["__complex__"]
        return complex(decode_value(re_), decode_value(im))
    if "__bytes__" in data:
        return bytes.fromhex(data["__bytes__"])
    if "__int__" in data:
        return int(data["__int__"], 16)
    if "__float__" in data:
        return float(data["__float__"])
    if "__opaque__" in data:
        return Opaque(data["__opaque__"], data.get("repr", ""))
    raise ValueError(f"unknown tagged value {sorted(data)}")


def _hashable(value):
    if isinstance(value, list):
        return Opaque("list", repr(value))
    return value


def dumps(value) -> str:
    return json.dumps(encode_value(value), allow_nan=False)


def loads(text: str):
    return decode_value(json.loads(text))
