"""What the engine hands back per request: tokens, text, why it stopped, and where the time went."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class RequestTimings:
    """Wall-clock seconds (time.perf_counter based), all relative to the request's arrival."""

    queue_s: float = 0.0  # arrival -> first scheduled
    prefill_s: float = 0.0  # first scheduled -> prompt fully processed
    first_token_s: float = 0.0  # arrival -> first output token (TTFT)
    decode_s: float = 0.0  # first output token -> finish
    e2e_s: float = 0.0  # arrival -> finish

    @property
    def tpot_s(self) -> float | None:
        """Set by the caller that knows the token count; see RequestOutput.tpot_s."""
        return None


@dataclass(slots=True)
class SpecDecodeCounts:
    """Per-request speculative decoding counts (zeros when speculation is off)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    error: str | None = None  # set when finish_reason == "abort" because the request was refused
    logprobs: list[dict[int, float]] | None = None  # per generated token: {token_id: logprob}
    prompt_logprobs: list[float | None] | None = None  # per prompt token; first is None
    prompt_top_logprobs: list[dict[int, float] | None] | None = None  # prompt_logprobs = N > 0: the N likeliest
    prompt_ranks: list[int | None] | None = None  # prompt_logprobs = N > 0: each prompt token's rank (1 = argmax)
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    timings: RequestTimings = field(default_factory=RequestTimings)
    spec: SpecDecodeCounts = field(default_factory=SpecDecodeCounts)
    finished: bool = True
    probs: Any = None  # [num_tokens, V] sampling distributions, only when requested (draft engines)

    @classmethod
    def refused(cls, request_id: str, prompt: str | None, prompt_token_ids: list[int], error: str) -> "RequestOutput":
        """The output of a request the engine refused up front: nothing generated, `error` says why."""
        return cls(request_id=request_id, prompt=prompt, prompt_token_ids=list(prompt_token_ids), token_ids=[],
                   text="", finish_reason="abort", error=error)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first."""
        n = len(self.token_ids)
        return self.timings.decode_s / (n - 1) if n > 1 else None


@dataclass
class ScoreOutput:
    """Per-token log-probabilities of a prompt: logprobs[i] = log p(token[i+1] | tokens[:i+1])."""

    prompt_token_ids: list[int]
    logprobs: list[float]

    @property
    def sum_logprob(self) -> float:
        return float(sum(self.logprobs))

    @property
    def num_scored(self) -> int:
        return len(self.logprobs)
