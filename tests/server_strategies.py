"""Hypothesis strategies for OpenAI request bodies: mostly well-formed, with every field sometimes wrong.

Each field draws from its plausible values (so requests get past validation and exercise the
engine, templating, grammars and streaming) and, now and then, from hostile JSON: wrong types,
huge and negative numbers, lone surrogates, deep nesting. A body is then encoded as JSON and, now
and then, damaged as bytes.
"""
from __future__ import annotations

import json

from hypothesis import strategies as st

def weighted(*options: tuple[int, st.SearchStrategy]) -> st.SearchStrategy:
    """One of the strategies, picked with the given weights (`st.one_of` merges identical branches,
    so repeating a branch there does not weigh it)."""
    table = [strategy for weight, strategy in options for _ in range(weight)]
    return st.sampled_from(range(len(table))).flatmap(lambda i: table[i])


SURROGATES = st.sampled_from(["\ud800", "\udfff", "a\udc00b"])
_WORDS = st.sampled_from(["hi", "Hello world", "<tool_call>", "</think>", "<|im_end|>", "\x00", "🙂", ""])
TEXT = weighted((1, st.text(min_size=1, max_size=12)), (3, _WORDS))  # plausible text: valid Unicode
HOSTILE_TEXT = weighted((3, TEXT), (1, SURROGATES))
NUMBER = st.one_of(st.integers(-2**70, 2**70), st.floats(allow_nan=True, allow_infinity=True),
                   st.sampled_from([0, -1, 1, 2**31, 2**63, 10**12, 1e-300, 1e300, 0.5]))
SCALAR = st.one_of(st.none(), st.booleans(), NUMBER, HOSTILE_TEXT)
GARBAGE = st.recursive(SCALAR, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                       st.dictionaries(HOSTILE_TEXT, inner, max_size=3)), max_leaves=8)
DEEP = st.integers(1, 200).map(lambda n: json.loads("[" * n + "]" * n) if n < 900 else [])


def rarely_bad(good: st.SearchStrategy) -> st.SearchStrategy:
    """`good` nineteen times in twenty, hostile JSON otherwise (for values nested inside a body)."""
    return weighted((19, good), (1, GARBAGE))


def mostly(good: st.SearchStrategy, *wrong) -> st.SearchStrategy:
    """`good` five times in six, otherwise one of the `wrong` values (out of range, wrong type)."""
    return weighted((5, good), (1, st.sampled_from(wrong)))


TOKEN_ID = weighted((5, st.integers(0, 383)), (1, st.integers(-5, 10**12)))
TOKEN_IDS = st.lists(TOKEN_ID, max_size=6)
SCHEMA = st.one_of(
    st.just({"type": "object"}),
    st.just({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}),
    st.just({"type": "string", "maxLength": 3}),
    st.just({"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 2}),
    st.just({"type": "integer", "minimum": 5, "maximum": 1}),
    st.just({"$ref": "#/nope"}),
    st.dictionaries(st.sampled_from(["type", "properties", "items", "enum", "pattern"]), GARBAGE, max_size=2))

SAMPLING = {
    "model": mostly(st.just("tiny"), "nope", ""),
    "n": mostly(st.integers(1, 2), 0, -1, 129, 2**40),
    "temperature": mostly(st.floats(0, 2), 1e-300, 1e-6, 1e300, -1, "1"),
    "top_p": mostly(st.floats(0.01, 1), 0, 1e-300, 1.5, -0.1),
    "top_k": mostly(st.integers(-1, 500), -2, 2**62),
    "min_p": mostly(st.floats(0, 1), -0.5, 1.5),
    "seed": mostly(st.integers(0, 2**63 - 1), -1, 2**63, 2**64),
    "stop": mostly(st.one_of(TEXT, st.lists(TEXT, max_size=4)), ["a" * 600], [""], [5]),
    "stop_token_ids": TOKEN_IDS,
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans(),
                                                         "continuous_usage_stats": st.booleans()}),
    "ignore_eos": st.booleans(),
    "min_tokens": mostly(st.integers(0, 2), -1, 6),
    "skip_special_tokens": st.booleans(),
    "include_stop_str_in_output": st.booleans(),
    "presence_penalty": mostly(st.just(0), 0.5),
    "logit_bias": mostly(st.just({}), {"1": 5.0}),
    "response_format": st.one_of(
        st.fixed_dictionaries({"type": mostly(st.sampled_from(["text", "json_object"]), "json_schema", "xml")}),
        st.fixed_dictionaries({"type": st.just("json_schema"),
                               "json_schema": st.fixed_dictionaries({"name": st.just("x")},
                                                                    optional={"schema": SCHEMA})})),
    "guided_json": st.one_of(SCHEMA, st.just('{"type": "boolean"}'), TEXT),
    "guided_regex": st.sampled_from(["a|b", "[0-9]{1,2}", "(", "", ".*"]),
    "guided_choice": mostly(st.lists(TEXT, min_size=1, max_size=3), []),
    "guided_grammar": st.sampled_from(['start: "yes" | "no"', 'start: "yes" | "no"', "start: (", ""]),
    "request_id": TEXT,
    "return_tokens_as_token_ids": st.booleans(),
}

MESSAGE = st.fixed_dictionaries(
    {"role": rarely_bad(st.sampled_from(["user", "user", "system", "assistant", "tool", "developer"]))},
    optional={"content": rarely_bad(st.one_of(TEXT, st.lists(st.one_of(
                  st.fixed_dictionaries({"type": st.sampled_from(["text", "text", "image_url"]), "text": TEXT}), TEXT),
                  max_size=2))),
              "name": TEXT,
              "tool_calls": rarely_bad(st.lists(st.fixed_dictionaries(
                  {"id": TEXT, "type": st.just("function"),
                   "function": st.fixed_dictionaries({"name": TEXT},
                                                     optional={"arguments": rarely_bad(TEXT)})}),
                  max_size=2))})
TOOL = st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
    {"name": st.sampled_from(["get_weather", "f"])}, optional={"parameters": SCHEMA, "description": TEXT})})

CHAT_ONLY = {
    "max_completion_tokens": st.one_of(st.integers(1, 3), st.sampled_from([-1, 0, 10**6])),
    "logprobs": st.booleans(),
    "top_logprobs": mostly(st.integers(0, 20), -1, 21),
    "tools": st.lists(TOOL, max_size=2),
    "tool_choice": st.one_of(mostly(st.sampled_from(["none", "auto", "required"]), "any"),
                             st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
                                 {"name": st.sampled_from(["get_weather", "nope"])})})),
    "add_generation_prompt": st.booleans(),
    "chat_template_kwargs": st.dictionaries(st.sampled_from(["enable_thinking", "tools", "messages"]), GARBAGE,
                                            max_size=1),
}
COMPLETION_ONLY = {
    "echo": st.booleans(),
    "logprobs": mostly(st.integers(0, 20), -1, 21),
    "prompt_logprobs": mostly(st.integers(0, 20), -1, 21),
    "best_of": mostly(st.just(1), 0, 3),
    "suffix": mostly(st.just(""), "x"),
    "add_special_tokens": st.booleans(),
}


@st.composite
def request_body(draw, required: dict, optional: dict) -> dict:
    """A body in one of three moods: plausible throughout, plausible with one field replaced by
    hostile JSON, or hostile in every field."""
    mood = draw(st.sampled_from(["plausible"] * 4 + ["one_field_bad"] * 2 + ["all_bad"]))
    names = draw(st.lists(st.sampled_from(sorted(optional)), unique=True, max_size=6))
    fields = {**{k: required[k] for k in required}, **{k: optional[k] for k in names}}
    body = {k: draw(weighted((1, v), (2, GARBAGE), (1, DEEP)) if mood == "all_bad" else v) for k, v in fields.items()}
    if mood == "one_field_bad":
        body[draw(st.sampled_from(sorted(fields)))] = draw(st.one_of(GARBAGE, DEEP))
    return body


# max_tokens stays small: a request the server accepts costs real engine steps
MAX_TOKENS = mostly(st.integers(1, 3), 0, -1, 10**6)
CHAT_BODY = request_body({"messages": st.lists(MESSAGE, min_size=1, max_size=3), "max_tokens": MAX_TOKENS},
                         {**SAMPLING, **CHAT_ONLY})
COMPLETION_BODY = request_body(
    {"prompt": st.one_of(TEXT, st.lists(TEXT, max_size=3), TOKEN_IDS, st.lists(TOKEN_IDS, max_size=2)),
     "max_tokens": MAX_TOKENS},
    {**SAMPLING, **COMPLETION_ONLY})
TOKENIZE_BODY = st.one_of(
    request_body({"prompt": TEXT}, {"add_special_tokens": st.booleans(), "model": st.just("tiny")}),
    request_body({"messages": st.lists(MESSAGE, min_size=1, max_size=2)},
                 {"add_generation_prompt": st.booleans(), "tools": st.lists(TOOL, max_size=1),
                  "chat_template_kwargs": CHAT_ONLY["chat_template_kwargs"]}))
DETOKENIZE_BODY = request_body({"tokens": TOKEN_IDS}, {"model": st.just("tiny")})
BODIES = {"/v1/chat/completions": CHAT_BODY, "/v1/completions": COMPLETION_BODY, "/tokenize": TOKENIZE_BODY,
          "/detokenize": DETOKENIZE_BODY}


def encode(body: dict) -> bytes:
    """JSON as a client would send it; NaN and Infinity come out as the bare literals Python writes."""
    return json.dumps(body, allow_nan=True).encode("utf-8", "surrogatepass")


@st.composite
def damaged(draw, body: st.SearchStrategy) -> bytes:
    """An encoded body, sometimes with bytes cut, inserted or flipped."""
    raw = encode(draw(body))
    how = draw(st.sampled_from(["none"] * 7 + ["truncate", "insert", "flip"]))
    if how == "none" or not raw:
        return raw
    at = draw(st.integers(0, len(raw) - 1))
    if how == "truncate":
        return raw[:at]
    if how == "insert":
        return raw[:at] + draw(st.binary(min_size=1, max_size=4)) + raw[at:]
    return raw[:at] + bytes([raw[at] ^ draw(st.integers(1, 255))]) + raw[at + 1:]
