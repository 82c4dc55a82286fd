"""The soak benchmark's traffic: what each client sends, how one request is sent, and what came back.

A request is drawn at random from a mix that exercises the server's long-lived state: prompts that
share a long prefix (prefix-cache hits) or share nothing, prompts full of repetition (n-gram drafts)
or not, /v1/chat/completions and /v1/completions, streaming or not, greedy or seeded sampling,
max_tokens across a range, and streams the client drops after a few chunks. Besides, a trickle of
malformed requests (Malformed): each must get a 4xx with the OpenAI error body. An unknown field is
ignored (as vLLM does), so that probe must get a 200.
"""
from __future__ import annotations

import json
import random
import time
from dataclasses import asdict, dataclass

import httpx

from onecat.gates.engines.openai_client import stream_completion

WORDS = ("river stone lamp garden window copper meadow signal harbor lantern orchard bridge engine pocket "
         "marble thunder velvet compass island ladder canyon ribbon saddle beacon kettle violin glacier "
         "falcon tunnel harvest timber quartz walnut prism anchor blossom cobalt ember fossil").split()
TOPICS = ("the sea", "a small robot", "autumn", "a lighthouse", "bread", "the moon", "trains", "a city at night")


def _document(seed: int, sentences: int) -> str:
    """A long, fixed text: the shared prefix of many requests."""
    rng = random.Random(seed)
    lines = [f"Operations manual, volume {seed}."]
    for k in range(sentences):
        lines.append(f"Rule {k + 1}: the {rng.choice(WORDS)} must stay near the {rng.choice(WORDS)} unless the "
                     f"{rng.choice(WORDS)} is {rng.choice(('open', 'closed', 'wet', 'cold', 'lit'))}.")
    return "\n".join(lines)


SHARED_DOCS = [_document(seed, 28) for seed in range(3)]  # ~500 tokens each, a few KV blocks each


@dataclass
class Planned:
    """One request to send: a JSON body (or raw bytes for a body that is not JSON) and what it must get."""

    path: str
    kind: str  # shared_prefix | unique | repetitive | malformed:<case> | unknown_field
    body: dict | None = None
    raw: bytes | None = None
    stream: bool = False
    disconnect_after: int | None = None
    expect: str = "ok"  # ok | 4xx


@dataclass
class Outcome:
    """What one request got; times in seconds since the soak started (client-side)."""

    kind: str
    path: str
    stream: bool
    expect: str
    started_s: float
    finished_s: float = 0.0
    generation: int = 0  # which server process answered (the caller restarts it after a fault)
    status: int = 0  # HTTP status; 0: no answer (connection refused, reset, timeout)
    error_code: int | None = None  # the `code` of an OpenAI error body, also one sent inside a stream
    openai_error_body: bool | None = None  # for a non-2xx answer: it had the OpenAI error shape
    ok: bool = False
    disconnected: bool = False
    ttft_s: float | None = None
    tpot_s: float | None = None
    completion_tokens: int = 0
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens (non-streaming answers)
    error: str | None = None
    fault: bool = False  # answered after a deliberate worker kill, before the restart

    @property
    def status_key(self) -> str:
        """How the answer is counted: the HTTP status, `stream_error_<code>` for an error event sent after a
        200, `no_answer` when none came."""
        if self.status == 0:
            return "no_answer"
        if self.status == 200 and self.error_code is not None:
            return f"stream_error_{self.error_code}"
        if self.status == 200 and not self.ok and not self.disconnected:
            return "stream_broken"
        return str(self.status)

    @property
    def is_5xx(self) -> bool:
        return self.status >= 500 or (self.error_code or 0) >= 500

    def as_dict(self) -> dict:
        return asdict(self)


def _user_text(rng: random.Random, kind: str) -> str:
    if kind == "repetitive":
        cycle = rng.sample(WORDS, rng.randint(3, 5))
        listing = ", ".join(cycle * rng.randint(6, 10))
        return f"Continue this list exactly as it goes on, without comments: {listing},"
    nonce = " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 120)))
    return f"[{rng.getrandbits(48):x}] {nonce}. Write a short poem about {rng.choice(TOPICS)}."


def plan_request(rng: random.Random, model: str, max_tokens: tuple[int, int], stream_frac: float = 0.6,
                 disconnect_frac: float = 0.15) -> Planned:
    """A well-formed request from the mix."""
    kind = rng.choices(("shared_prefix", "unique", "repetitive"), weights=(0.4, 0.35, 0.25))[0]
    chat = rng.random() < 0.5
    body: dict = {"model": model, "max_tokens": rng.randint(*max_tokens)}
    if rng.random() < 0.5:
        body["temperature"] = 0.0
    else:
        body.update(temperature=0.8, top_p=0.95, seed=rng.randrange(2**31))
    if kind == "shared_prefix":
        doc = rng.choice(SHARED_DOCS)
        question = f"Which rule mentions the {rng.choice(WORDS)}? ({rng.getrandbits(32):x})"
        if chat:
            body["messages"] = [{"role": "system", "content": doc}, {"role": "user", "content": question}]
        else:
            body["prompt"] = f"{doc}\n\nQuestion: {question}\nAnswer:"
    elif chat:
        body["messages"] = [{"role": "user", "content": _user_text(rng, kind)}]
    else:
        body["prompt"] = _user_text(rng, kind)
    stream = rng.random() < stream_frac
    leave = rng.randint(1, 4) if stream and rng.random() < disconnect_frac else None
    path = "/v1/chat/completions" if chat else "/v1/completions"
    return Planned(path, kind, body=body, stream=stream, disconnect_after=leave)


def _malformed_cases(model: str, max_model_len: int) -> list[Planned]:
    chat, comp = "/v1/chat/completions", "/v1/completions"
    msgs = [{"role": "user", "content": "hello"}]
    too_long = " ".join(["lantern"] * (2 * max_model_len))  # at least one token per word
    cases = [
        Planned(comp, "bad_json", raw=b'{"model": "%s", "prompt": "hi", "max_tokens": 8' % model.encode()),
        Planned(chat, "bad_json", raw=b'{"messages": [{"role": "user", "content": "hi"}],}'),
        Planned(comp, "not_an_object", raw=b"[1, 2, 3]"),
        Planned(comp, "negative_max_tokens", body={"model": model, "prompt": "hi", "max_tokens": -5}),
        Planned(chat, "negative_max_tokens", body={"model": model, "messages": msgs, "max_tokens": -1}),
        Planned(comp, "over_max_model_len", body={"model": model, "prompt": too_long, "max_tokens": 16}),
        Planned(chat, "over_max_model_len", body={"model": model, "max_tokens": 16,
                                                  "messages": [{"role": "user", "content": too_long}]}),
        Planned(comp, "wrong_type", body={"model": model, "prompt": "hi", "max_tokens": "ten"}),
        Planned(chat, "wrong_type", body={"model": model, "messages": "hello", "max_tokens": 8}),
        Planned(comp, "wrong_type", body={"model": model, "prompt": "hi", "temperature": "hot"}),
        Planned(chat, "unsupported_field", body={"model": model, "messages": msgs, "logit_bias": {"17": 5}}),
        Planned(comp, "unknown_model", body={"model": "no-such-model", "prompt": "hi", "max_tokens": 4}),
    ]
    for c in cases:
        c.kind, c.expect = f"malformed:{c.kind}", "4xx"
    cases.append(Planned(comp, "unknown_field", body={"model": model, "prompt": "hi", "max_tokens": 4,
                                                     "frobnicate": {"level": 3}}))
    return cases


class Malformed:
    """Cycles through the malformed cases, so a short run sees each kind."""

    def __init__(self, model: str, max_model_len: int):
        self.cases = _malformed_cases(model, max_model_len)
        self.next = 0

    def plan(self) -> Planned:
        case = self.cases[self.next % len(self.cases)]
        self.next += 1
        return case


def _json_or_none(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return None


def openai_error_code(text: str) -> tuple[bool, int | None]:
    """(the text is an OpenAI error body `{"error": {message, type, param, code}}`, its code)."""
    try:
        err = json.loads(text)["error"]
    except (ValueError, KeyError, TypeError):
        return False, None
    if not isinstance(err, dict):
        return False, None
    shaped = set(err) == {"message", "type", "param", "code"} and bool(err["message"]) and bool(err["type"])
    code = err.get("code") if isinstance(err.get("code"), int) else None
    return shaped, code


async def send(client: httpx.AsyncClient, plan: Planned, t0: float, timeout_s: float) -> Outcome:
    """Send `plan` and time it; never raises for what the server does (errors go into the Outcome)."""
    out = Outcome(plan.kind, plan.path, plan.stream, plan.expect, started_s=time.monotonic() - t0)
    if plan.stream:
        res = await stream_completion(client, plan.path, plan.body, chat=plan.path.endswith("chat/completions"),
                                      disconnect_after_chunks=plan.disconnect_after, timeout_s=timeout_s)
        out.status, out.ok, out.disconnected, out.error = res.status, res.ok, res.disconnected, res.error
        out.ttft_s, out.tpot_s = res.ttft_s, (None if res.disconnected else res.tpot_s)
        out.completion_tokens = res.completion_tokens or res.num_chunks
        if res.error and res.status and res.status != 200:
            out.openai_error_body, out.error_code = openai_error_code(res.error)
        elif res.error and res.status == 200:  # an error event inside the stream, or the stream broke
            _, out.error_code = openai_error_code(json.dumps({"error": _json_or_none(res.error)}))
    else:
        try:
            kw = {"content": plan.raw, "headers": {"content-type": "application/json"}} if plan.raw is not None \
                else {"json": plan.body}
            r = await client.post(plan.path, timeout=timeout_s, **kw)
            out.status = r.status_code
            if r.status_code == 200:
                usage = r.json().get("usage") or {}
                out.ok = True
                out.completion_tokens = usage.get("completion_tokens") or 0
                out.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            else:
                out.openai_error_body, out.error_code = openai_error_code(r.text)
                out.error = r.text[:300]
        except (httpx.HTTPError, ValueError) as exc:
            out.error = f"{type(exc).__name__}: {exc}"[:300]
    out.finished_s = time.monotonic() - t0
    return out


def answered_as_expected(out: Outcome) -> bool:
    """A malformed request got a 4xx with the OpenAI error body whose code is the status; the unknown-field
    probe got a 200."""
    if out.expect == "4xx":
        return 400 <= out.status < 500 and bool(out.openai_error_body) and out.error_code == out.status
    return out.status == 200
