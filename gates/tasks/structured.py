"""Structured output: JSON-schema tasks and the validity of a reply against its schema.

Each task is a prompt plus a JSON Schema (draft 2020-12). A reply is checked twice:
  strict  -- the whole reply (whitespace aside) is one JSON value that validates;
  lenient -- the JSON found in a ```json fence, or the outermost {...} span, validates.
Constrained decoding (when the server grows it) should make strict == lenient == 100%.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from jsonschema import Draft202012Validator


@dataclass(frozen=True)
class SchemaTask:
    task_id: str
    instruction: str
    schema: dict = field(hash=False)

    def prompt(self) -> str:
        return (f"{self.instruction}\n\nReply with only a JSON object that conforms to this JSON Schema, "
                f"with no other text:\n{json.dumps(self.schema)}")

    def messages(self) -> list[dict]:
        return [{"role": "user", "content": self.prompt()}]


def _obj(props: dict, required: list[str] | None = None, **extra) -> dict:
    return {"type": "object", "properties": props, "required": required or list(props),
            "additionalProperties": False, **extra}


TASKS: list[SchemaTask] = [
    SchemaTask("person", "Describe a fictional person: their name, age in years and email address.",
               _obj({"name": {"type": "string", "minLength": 1}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
                     "email": {"type": "string", "pattern": r"^[^@\s]+@[^@\s]+\.[^@\s]+$"}})),
    SchemaTask("weather", "Give a weather report for Paris: the temperature in Celsius, the sky condition and "
               "the wind speed in km/h.",
               _obj({"city": {"type": "string"}, "temperature_c": {"type": "number", "minimum": -90, "maximum": 60},
                     "condition": {"enum": ["sunny", "cloudy", "rain", "snow", "fog"]},
                     "wind_kmh": {"type": "number", "minimum": 0}})),
    SchemaTask("shopping_list", "Write a shopping list for a pancake breakfast with at least three items, each "
               "with a quantity.",
               _obj({"items": {"type": "array", "minItems": 3, "items": _obj(
                   {"name": {"type": "string", "minLength": 1}, "quantity": {"type": "integer", "minimum": 1}})}})),
    SchemaTask("book", "Describe a well-known novel: title, author, publication year and genres.",
               _obj({"title": {"type": "string"}, "author": {"type": "string"},
                     "year": {"type": "integer", "minimum": 1000, "maximum": 2100},
                     "genres": {"type": "array", "items": {"type": "string"}, "minItems": 1, "uniqueItems": True}})),
    SchemaTask("sentiment", "Classify the sentiment of the sentence \"The food was cold and the waiter was rude.\" "
               "and give a confidence between 0 and 1.",
               _obj({"label": {"enum": ["positive", "negative", "neutral"]},
                     "confidence": {"type": "number", "minimum": 0, "maximum": 1}})),
    SchemaTask("calendar_event", "Create a calendar event for a team meeting next Monday at 10:00 lasting "
               "30 minutes, with two attendees.",
               _obj({"title": {"type": "string"}, "date": {"type": "string", "pattern": r"^\d{4}-\d{2}-\d{2}$"},
                     "start": {"type": "string", "pattern": r"^([01]\d|2[0-3]):[0-5]\d$"},
                     "duration_min": {"type": "integer", "minimum": 1},
                     "attendees": {"type": "array", "items": {"type": "string"}, "minItems": 2}})),
    SchemaTask("math_answer", "What is 17 multiplied by 23? Give the result and a one-sentence explanation.",
               _obj({"answer": {"type": "integer"}, "explanation": {"type": "string", "maxLength": 300}})),
    SchemaTask("address", "Give a postal address for a fictional company in Berlin.",
               _obj({"company": {"type": "string"}, "street": {"type": "string"}, "city": {"type": "string"},
                     "postal_code": {"type": "string", "pattern": r"^\d{5}$"},
                     "country_code": {"type": "string", "pattern": r"^[A-Z]{2}$"}})),
    SchemaTask("recipe", "Give a short recipe for a cup of tea: its name, preparation time in minutes and the "
               "ordered steps.",
               _obj({"name": {"type": "string"}, "minutes": {"type": "integer", "minimum": 1, "maximum": 120},
                     "steps": {"type": "array", "minItems": 2, "items": _obj(
                         {"order": {"type": "integer", "minimum": 1}, "text": {"type": "string"}})}})),
    SchemaTask("entities", "Extract the people and places named in: \"Ada Lovelace met Charles Babbage in London.\"",
               _obj({"people": {"type": "array", "items": {"type": "string"}},
                     "places": {"type": "array", "items": {"type": "string"}}})),
    SchemaTask("product", "Describe a product for an online store: an id, a name, a price in EUR and whether it "
               "is in stock, plus optional tags.",
               _obj({"id": {"type": "string", "pattern": r"^[A-Z0-9-]{3,20}$"}, "name": {"type": "string"},
                     "price_eur": {"type": "number", "exclusiveMinimum": 0}, "in_stock": {"type": "boolean"},
                     "tags": {"type": "array", "items": {"type": "string"}}},
                    required=["id", "name", "price_eur", "in_stock"])),
]

for _t in TASKS:
    Draft202012Validator.check_schema(_t.schema)

TASKS_BY_ID = {t.task_id: t for t in TASKS}

_JSON_FENCE = re.compile(r"```(?:json)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)


@dataclass(frozen=True)
class Validity:
    parsed: bool           # some JSON value could be read (lenient)
    valid: bool            # lenient value validates
    strict_valid: bool     # the whole reply is JSON and validates
    method: str            # whole | fence | braces | none
    errors: tuple[str, ...] = ()


def _validate(value, schema) -> list[str]:
    validator = Draft202012Validator(schema)
    return [f"{'/'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}"[:200]
            for e in sorted(validator.iter_errors(value), key=lambda e: list(map(str, e.path)))]


def _outer_braces(text: str) -> str | None:
    start, end = text.find("{"), text.rfind("}")
    return text[start:end + 1] if 0 <= start < end else None


def check_reply(reply: str, task: SchemaTask) -> Validity:
    """Validity of one reply for one task (never raises on malformed replies)."""
    stripped = reply.strip()
    candidates = [("whole", stripped)]
    fence = _JSON_FENCE.search(reply)
    if fence:
        candidates.append(("fence", fence.group(1).strip()))
    braces = _outer_braces(reply)
    if braces:
        candidates.append(("braces", braces))
    strict_valid = False
    first_errors: list[str] | None = None
    for method, text in candidates:
        try:
            value = json.loads(text)
        except ValueError:
            continue
        errors = _validate(value, task.schema)
        if method == "whole":
            strict_valid = not errors
        if not errors:
            return Validity(True, True, strict_valid, method)
        if first_errors is None:
            first_errors = errors
    if first_errors is not None:
        return Validity(True, False, False, "invalid", tuple(first_errors[:5]))
    return Validity(False, False, False, "none", ("no JSON value found in the reply",))
