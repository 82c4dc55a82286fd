"""Python values <-> tagged JSON, so test inputs and outputs cross the sandbox boundary as data.

Pickle would let a sandboxed program run code in the harness when its output is read back; this
encoding can only ever produce plain values. Tuples, sets, dicts with any keys, complex, bytes and
huge ints survive the round trip; subclasses of those (Counter, OrderedDict, namedtuple, IntEnum ...)
and numpy scalars cross as the plain value they equal under ==; anything else becomes an `Opaque`
(type name + repr) that equals only an Opaque with the same type and repr. Stdlib only: the sandbox driver embeds this source.
"""

import json
import math

_BIG_INT_DIGITS = 4000  # decimal conversion of larger ints is refused by CPython's default limit
DIGEST_MIN_CHARS = 100_000  # a string result this long crosses as a digest
DIGEST_MIN_ITEMS = 10_000  # a float-free list/tuple result this long crosses as a digest, not as data


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


class Digest:
    """A huge list/tuple result, reduced to its type, length and a sha256 over its items' canonical
    texts (items_sha256: 2 and 2.0 alike, as == sees them).

    Equal to a Digest of the same type, length and hash, or to a list/tuple that digests to it: exact
    equality, which is what such results without fractional floats (e.g. 1.6M combinations in
    MBPP+/255) are compared with anyway.
    """

    __slots__ = ("type_name", "length", "sha256")

    def __init__(self, type_name, length, sha256):
        self.type_name, self.length, self.sha256 = type_name, length, sha256

    def __eq__(self, other):
        if type(other) in (list, tuple) and len(other) == self.length:  # one side digested, the other not
            other = Digest(type(other).__name__, len(other), items_sha256(other))
        return isinstance(other, Digest) and (self.type_name, self.length, self.sha256) == (
            other.type_name, other.length, other.sha256)

    def __hash__(self):
        return hash(self.sha256)

    def __repr__(self):
        return f"<{self.type_name} of {self.length} items, sha256 {self.sha256[:12]}>"


def _canonical(item):
    """The text of an item as == sees it: equal numbers (True, 1, 1.0) give one text, lists and tuples
    recurse; anything else is its repr."""
    kind = type(item)
    if kind is bool or kind is int or (kind is float and item.is_integer() and abs(item) < 2 ** 63):
        return str(int(item))
    if kind is list or kind is tuple:
        inner = ",".join(_canonical(x) for x in item)
        return f"[{inner}]" if kind is list else f"({inner})"
    return repr(item)


def items_sha256(items):
    """sha256 over the items' canonical texts: lists equal under == (2 vs 2.0) digest alike."""
    import hashlib
    h = hashlib.sha256()
    for item in items:
        h.update(_canonical(item).encode("utf-8", "surrogatepass"))
        h.update(b"\x1e")
    return h.hexdigest()


def _fractional(x):
    return type(x) is float and not x.is_integer()


def encode_result(value):
    """encode_value, except that very long lists/tuples/strings become a Digest (memory, time flat)."""
    kind = type(value)
    if kind is str and len(value) >= DIGEST_MIN_CHARS:
        import hashlib
        return {"__digest__": "str", "n": len(value),
                "sha256": hashlib.sha256(value.encode("utf-8", "surrogatepass")).hexdigest()}
    if ((kind is list or kind is tuple) and len(value) >= DIGEST_MIN_ITEMS
            and not any(_fractional(x) for x in value[:1000])):  # fractional floats keep their tolerance
        return {"__digest__": kind.__name__, "n": len(value), "sha256": items_sha256(value)}
    return encode_value(value)


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
    if isinstance(value, Digest):
        return {"__digest__": value.type_name, "n": value.length, "sha256": value.sha256}
    plain = _as_plain(value)
    if plain is not None:
        return encode_value(plain, _depth)
    try:
        text = repr(value)[:2000]
    except BaseException:
        text = "<unrepresentable>"
    return {"__opaque__": f"{kind.__module__}.{kind.__qualname__}", "repr": text}


_PLAIN_TYPES = (int, float, complex, str, bytes, tuple, list, dict, set, frozenset)


def _as_plain(value):
    """The plain value that `value` equals under ==, when it is an instance of a subclass of a builtin
    value type (Counter, OrderedDict, defaultdict, namedtuple, IntEnum, a str subclass ...) or a numpy
    scalar; None for anything else. A Counter equal to the expected dict is a right answer, as Python's
    own == (and EvalPlus) says."""
    kind = type(value)
    if kind.__module__ == "numpy" and getattr(value, "shape", None) == () and callable(getattr(value, "item", None)):
        return value.item()
    for base in _PLAIN_TYPES:
        if isinstance(value, base):
            if base is dict:
                return dict(value.items())
            return value[:] if base is str else base(value)
    return None


MAX_DECODE_DEPTH = 256  # encode_value refuses > 200 levels; anything deeper is not ours


def _tag_body(data, tag, keys, body_type):
    if set(data) != keys:
        raise ValueError(f"tagged value {tag} has keys {sorted(data)[:5]}")
    body = data[tag]
    if type(body) is not body_type:
        raise ValueError(f"tagged value {tag} holds a {type(body).__name__}")
    return body


def decode_value(data, _depth=0):
    """The value `encode_value` encoded; anything that is not exactly that encoding is refused
    (ValueError), so a malformed or hostile message can never decode to a surprising object."""
    if _depth > MAX_DECODE_DEPTH:
        raise ValueError("value nested too deeply to decode")
    kind = type(data)
    if data is None or kind is bool or kind is int or kind is float or kind is str:
        return data
    d = _depth + 1
    if kind is list:
        return [decode_value(v, d) for v in data]
    if kind is not dict or not data:
        raise ValueError(f"not an encoded value: {kind.__name__}")
    tag = next(iter(data)) if len(data) == 1 else next((k for k in data if k in ("__digest__", "__opaque__")), "")
    if tag in ("__tuple__", "__set__", "__frozenset__"):
        items = [decode_value(v, d) for v in _tag_body(data, tag, {tag}, list)]
        if tag == "__tuple__":
            return tuple(items)
        return (set if tag == "__set__" else frozenset)(_hashable(v) for v in items)
    if tag == "__dict__":
        out = {}
        for pair in _tag_body(data, tag, {tag}, list):
            if type(pair) is not list or len(pair) != 2:
                raise ValueError("__dict__ items must be [key, value] pairs")
            out[_hashable(decode_value(pair[0], d))] = decode_value(pair[1], d)
        return out
    if tag == "__complex__":
        parts = [decode_value(v, d) for v in _tag_body(data, tag, {tag}, list)]
        if len(parts) != 2 or not all(type(v) in (int, float) for v in parts):
            raise ValueError("__complex__ must hold two numbers")
        return complex(parts[0], parts[1])
    if tag == "__bytes__":
        return bytes.fromhex(_tag_body(data, tag, {tag}, str))
    if tag == "__int__":
        return int(_tag_body(data, tag, {tag}, str), 16)
    if tag == "__float__":
        return float(_tag_body(data, tag, {tag}, str))
    if tag == "__digest__":
        name = _tag_body(data, tag, {tag, "n", "sha256"}, str)
        if type(data["n"]) is not int or type(data["sha256"]) is not str:
            raise ValueError("__digest__ needs an int n and a str sha256")
        return Digest(name, data["n"], data["sha256"])
    if tag == "__opaque__":
        name = _tag_body(data, tag, {tag, "repr"} if "repr" in data else {tag}, str)
        text = data.get("repr", "")
        if type(text) is not str:
            raise ValueError("__opaque__ repr must be a str")
        return Opaque(name, text)
    raise ValueError(f"unknown tagged value {sorted(data)[:5]}")


def _hashable(value):
    if isinstance(value, list):
        return Opaque("list", repr(value))
    hash(value)  # TypeError for anything else unhashable (e.g. a dict as a set member)
    return value


def dumps(value) -> str:
    return json.dumps(encode_value(value), allow_nan=False)


def loads(text: str):
    return decode_value(json.loads(text))
