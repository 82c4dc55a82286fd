"""One request's live state inside the engine: tokens, progress, KV blocks, timings."""
from __future__ import annotations

import time
from dataclasses import dataclass
from enum import Enum

import torch

from onecat.engine.outputs import SpecDecodeCounts
from onecat.engine.sampling_params import SamplingParams


class SequenceStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    __slots__ = ("request_id", "prompt", "token_ids", "num_prompt_tokens", "params", "status",
                 "num_computed_tokens", "block_table", "block_hashes", "num_cached_tokens", "seed",
                 "finish_reason", "stop_reason", "logprobs", "prompt_logprobs", "prompt_top_logprobs", "prompt_ranks",
                 "arrival_time",
                 "first_scheduled_time", "first_token_time", "finish_time", "text", "spec", "num_preemptions",
                 "draft_tokens", "kept_probs", "state_slot")

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
                 seed: int):
        self.request_id = request_id
        self.prompt = prompt
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []  # hashes of the full, computed blocks, in order
        self.num_cached_tokens = 0
        self.seed = seed  # keys every sampled draw with the token's position (keyed_draws.py)
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.logprobs: list[dict[int, float]] | None = [] if params.logprobs is not None else None
        self.prompt_logprobs: list[float | None] | None = [None] if params.prompt_logprobs is not None else None
        # prompt_logprobs = N > 0: per prompt token also {token id: logprob} of the N likeliest and its own
        self.prompt_top_logprobs: list[dict[int, float] | None] | None = (
            [None] if params.prompt_logprobs else None)
        self.prompt_ranks: list[int | None] | None = [None] if params.prompt_logprobs else None
        self.arrival_time = time.perf_counter()
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.finish_time: float | None = None
        self.text = ""
        self.spec = SpecDecodeCounts()
        self.num_preemptions = 0
        # speculative proposal awaiting verification: host values, or a 1-D tensor where the drafter left it on
        # the device (its values reach the host only with the verified tokens)
        self.draft_tokens: list[int] | torch.Tensor = []
        self.kept_probs: list = []  # sampling distributions, kept only when params.keep_probs
        self.state_slot: int | None = None  # hybrid models: its recurrent-state slot while it runs (state_cache.py)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def in_prompt(self) -> bool:
        return self.num_computed_tokens < self.num_prompt_tokens


@dataclass(slots=True)
class FeatureRows:
    """Rows first .. first + count - 1 of one step's tapped hidden states (a block drafter's features), kept
    as the step's tensor and a span rather than a slice: a batch's steps record a span per request, and the
    drafter gathers all queued spans at once when it drafts (speculative/dflash_cache.py)."""

    source: torch.Tensor  # [rows of the step, features]
    first: int
    count: int

    def rows(self) -> torch.Tensor:
        return self.source[self.first:self.first + self.count]


@dataclass(slots=True)
class SequenceUpdate:
    """What one engine step did for one sequence, before the core applies it (EngineCore.postprocess)."""

    seq: Sequence
    num_new_tokens: int  # KV positions the step computed, from seq.num_computed_tokens on
    # Tokens to append: none for a prefill chunk short of the prompt's end; after verification the
    # accepted drafts (their KV is already written) and the token that follows them.
    new_tokens: list[int]
    features: FeatureRows | None = None  # the target's tapped hidden states of the kept positions
