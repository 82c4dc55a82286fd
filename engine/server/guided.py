"""Grammar-constrained decoding (JSON schema, regex, Lark) through llguidance.

A `GrammarLogitsProcessor` is a per-request callable `fn(output_token_ids, logits) -> logits`
(vLLM's logits-processor signature): it advances an llguidance matcher over the tokens generated
since its last call, then sets every token the grammar forbids to -inf. The server attaches it as
`SamplingParams.logits_processors = [fn]`.

The engine calls each processor on the request's logits row before sampling
(engine/core/sampler.py: apply_logits_processors) and never drafts speculative tokens for such a request.
"""
from __future__ import annotations

import json
import threading
from typing import Any

import numpy as np
import torch

try:  # optional at import time so the server runs (without response_format) if it is missing
    import llguidance
except ImportError:  # pragma: no cover - dependency declared in pyproject
    llguidance = None


class GrammarError(ValueError):
    """A schema / grammar the constraint compiler refuses (HTTP 400)."""


class GuidedDecoding:
    """Builds matchers for one tokenizer; the llguidance tokenizer is built once (about 1 s)."""

    def __init__(self, tokenizer: Any, vocab_size: int):
        if llguidance is None:
            raise GrammarError("constrained decoding needs the `llguidance` package (pip install llguidance)")
        hf = getattr(tokenizer, "_tok", None)
        if hf is None:
            raise GrammarError("this tokenizer cannot be exported for constrained decoding")
        self.vocab_size = vocab_size
        self.ll_tokenizer = llguidance.LLTokenizer(hf.to_str(), n_vocab=vocab_size,
                                                   eos_token=list(tokenizer.eos_token_ids) or None)
        self._lock = threading.Lock()

    @staticmethod
    def grammar_for(response_format: dict | None = None, *, json_schema: Any = None, regex: str | None = None,
                    choice: list[str] | None = None, lark: str | None = None) -> str | None:
        """An llguidance grammar string from OpenAI `response_format` or vLLM's guided_* fields."""
        M = llguidance.LLMatcher
        opts = {"whitespace_flexible": False}
        if response_format:
            kind = response_format.get("type")
            if kind == "json_schema":
                spec = response_format.get("json_schema") or {}
                schema = spec.get("schema", spec.get("json_schema"))
                if schema is None:
                    raise GrammarError("response_format.json_schema.schema is missing")
                json_schema = schema
            elif kind == "json_object":
                json_schema = {"type": "object"}
            elif kind in (None, "text"):
                pass
            else:
                raise GrammarError(f"response_format.type {kind!r} is not supported; use text, json_object "
                                   "or json_schema")
        if json_schema is not None:
            if isinstance(json_schema, str):
                try:
                    json_schema = json.loads(json_schema)
                except json.JSONDecodeError as exc:
                    raise GrammarError(f"the JSON schema is not valid JSON: {exc}") from None
            if not isinstance(json_schema, dict):
                raise GrammarError("a JSON schema must be an object")
            try:
                return M.grammar_from_json_schema(json_schema, defaults=opts)
            except ValueError as exc:
                raise GrammarError(f"the JSON schema cannot be compiled: {exc}") from None
        if regex is not None:
            return M.grammar_from_regex(regex)
        if choice is not None:
            alts = " | ".join(json.dumps(c) for c in choice)
            return M.grammar_from_lark(f"start: {alts}")
        if lark is not None:
            return M.grammar_from_lark(lark)
        return None

    def processor(self, grammar: str) -> "GrammarLogitsProcessor":
        is_err, msgs = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self.ll_tokenizer)
        if is_err:
            raise GrammarError(f"invalid grammar: {msgs[0] if msgs else 'unknown error'}")
        return GrammarLogitsProcessor(llguidance.LLMatcher(self.ll_tokenizer, grammar, log_level=0),
                                      self.vocab_size)


class GrammarLogitsProcessor:
    """Masks the logits row to the tokens the grammar allows next."""

    def __init__(self, matcher: Any, vocab_size: int):
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.num_consumed = 0

    def __call__(self, output_token_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        new = output_token_ids[self.num_consumed:]
        if new:
            self.matcher.consume_tokens(list(new))
            self.num_consumed += len(new)
        if self.matcher.is_error():
            return logits  # the request has left the grammar (should not happen); do not wedge it
        allowed = self.allowed_mask()
        v = min(logits.shape[-1], allowed.shape[0])
        logits[..., :v] = logits[..., :v].masked_fill(~allowed[:v].to(logits.device), float("-inf"))
        if logits.shape[-1] > v:
            logits[..., v:] = float("-inf")
        return logits

    def allowed_mask(self) -> torch.Tensor:
        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        allowed = np.unpackbits(bits, bitorder="little")[:self.vocab_size].astype(bool)
        return torch.from_numpy(allowed)

    @property
    def error(self) -> str:
        return self.matcher.get_error()
