"""What the worker hands back for one step: the logits the core samples from, verifies or reads prompt
logprobs out of. Declared on the core's side, so the core reads a step without knowing who ran it."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class PromptLogprobs:
    """For a prefill chunk's positions whose next token is in the prompt: that token's logprob and, when
    the request asked for N > 0, its rank and the N likeliest tokens there."""

    values: list[float]
    tops: list[dict[int, float]] | None = None
    ranks: list[int] | None = None


@dataclass(slots=True)
class StepResult:
    logits: torch.Tensor  # [num_sampling_rows, V]: for each sequence that reached its end this step
    sample_rows: list[int]  # index into `scheduled` of each logits row (last position only)
    prompt_logprobs: dict[int, PromptLogprobs]  # scheduled index -> the chunk's next prompt tokens' logprobs
    verify_logits: dict[int, torch.Tensor]  # scheduled index -> [num_lookahead + 1, V] for speculative verify
