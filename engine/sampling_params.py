"""Per-request decoding settings, validated up front so bad values never reach torch."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # `import onecat.engine` stays light: no torch until an engine is built
    import torch


GREEDY_BELOW = 1e-5


class InvalidRequestError(ValueError):
    """A request (prompt or sampling settings) that the engine refuses, with what to change."""


@dataclass
class SamplingParams:
    """vLLM-compatible sampling settings. temperature == 0 means greedy."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # top-n logprobs per generated token (sampled token always included)
    prompt_logprobs: int | None = None  # 0: logprob of each prompt token given its prefix; N: also the N likeliest
    skip_special_tokens: bool = True
    # vLLM's per-request `fn(output_token_ids, logits_row) -> logits_row`, run on the request's logits
    # row before sampling (grammar constraints). Usually stateful: dataclasses.replace() shares them,
    # and == compares them by identity.
    logits_processors: list[Callable[[list[int], torch.Tensor], torch.Tensor]] = field(default_factory=list)
    keep_probs: bool = False  # hand back each step's sampling distribution (a draft engine's q)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.logits_processors = list(self.logits_processors or [])
        if self.top_k == -1:
            self.top_k = 0
        self.validate()

    @property
    def greedy(self) -> bool:
        """Temperatures below GREEDY_BELOW sample as greedy (as vLLM does): dividing logits by them overflows."""
        return self.temperature < GREEDY_BELOW

    def validate(self) -> None:
        def bad(what: str) -> InvalidRequestError:
            return InvalidRequestError(f"invalid sampling parameter: {what}")

        if self.n != 1:
            raise bad(f"n={self.n}; the engine generates one sequence per request (submit n requests)")
        if not (0.0 <= self.temperature < float("inf")):
            raise bad(f"temperature={self.temperature}; use 0 for greedy or a positive finite number")
        if not (0.0 < self.top_p <= 1.0):
            raise bad(f"top_p={self.top_p}; must be in (0, 1]")
        if self.top_k < 0:
            raise bad(f"top_k={self.top_k}; use 0 or -1 to disable, or a positive integer")
        if not (0.0 <= self.min_p <= 1.0):
            raise bad(f"min_p={self.min_p}; must be in [0, 1]")
        if self.max_tokens is not None and self.max_tokens < 0:
            raise bad(f"max_tokens={self.max_tokens}; must be >= 0 (0 only with prompt_logprobs)")
        if self.max_tokens == 0 and self.prompt_logprobs is None:
            raise bad("max_tokens=0 generates nothing; set prompt_logprobs to score the prompt")
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            raise bad(f"min_tokens={self.min_tokens}; must be in [0, max_tokens]")
        if self.logprobs is not None and self.logprobs < 0:
            raise bad(f"logprobs={self.logprobs}; must be >= 0")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            raise bad(f"prompt_logprobs={self.prompt_logprobs}; must be >= 0")
        if self.seed is not None and not (0 <= self.seed < 2**63):
            raise bad(f"seed={self.seed}; must be a non-negative 63-bit integer")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad(f"stop={self.stop!r}; stop strings must be non-empty strings")
        if any(not callable(fn) for fn in self.logits_processors):
            raise bad(f"logits_processors={self.logits_processors!r}; each must be a callable "
                      "fn(output_token_ids, logits_row) -> logits_row")
        if not isinstance(self.keep_probs, bool):
            raise bad(f"keep_probs={self.keep_probs!r}; must be True or False")
