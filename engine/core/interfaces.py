"""What the engine core needs of the two parts it is given: the worker that runs the model and, when
speculative decoding is on, the proposer that drafts and verifies. Declared here as protocols so that
the core imports neither (engine/worker/worker.py and engine/speculative/base.py implement them)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from onecat.engine.cache.recurrent_state import RecurrentStateCache
    from onecat.engine.config import ModelConfig
    from onecat.engine.core.scheduler_output import ScheduledSeq
    from onecat.engine.core.sequence import FeatureRows, Sequence
    from onecat.engine.core.step_result import StepResult
    from onecat.engine.tokenizer import Tokenizer


class DecodeGraphReplay(Protocol):
    """The worker's captured decode graphs, as the one-step-ahead pipeline replays them."""

    sizes: list[int]  # the captured batch sizes, ascending
    disabled_reason: str | None

    def replay(self, rows: list, size: int, ids_dev: torch.Tensor | None, q: int = 1) -> torch.Tensor | None: ...


class StepWorker(Protocol):
    """The model side of the engine: the model it loaded, the caches it sized, and the step it runs."""

    model_config: ModelConfig
    tokenizer: Tokenizer
    max_model_len: int
    num_kv_blocks: int
    device: torch.device
    states: RecurrentStateCache | None  # a hybrid model's recurrent states; None for attention-only models

    @property
    def graphs(self) -> DecodeGraphReplay | None: ...  # CUDA graphs of decode steps, when on

    @property
    def has_peer_ranks(self) -> bool: ...  # tensor parallel: other ranks run every step with this one

    def execute(self, scheduled: list[ScheduledSeq]) -> StepResult: ...

    def greedy_tokens(self, logits: torch.Tensor) -> torch.Tensor: ...

    def reset_counters(self) -> None: ...


class SpeculativeProposer(Protocol):
    """Drafts tokens for decoding sequences and verifies them against the target's logits
    (engine/speculative/base.py: SpeculativeDecoder)."""

    @property
    def wants_features(self) -> bool: ...  # a block drafter reads the target's hidden states

    def lookahead(self, running: list[Sequence]) -> dict[str, int]: ...

    def verify(self, blocks: list[tuple[Sequence, ScheduledSeq, torch.Tensor]],
               spans: list[FeatureRows] | None = None) -> list[list[int]]: ...

    def step_done(self, batch: int, drafted: bool, seconds: float, tokens_per_seq: float) -> None: ...

    def pipeline_paused(self, running: list[Sequence], in_flight: bool = False) -> bool: ...  # plain pipelined steps

    def release(self, seq: Sequence) -> None: ...

    def describe(self) -> dict: ...

    def step_features(self) -> torch.Tensor | None: ...

    def record_features(self, seq: Sequence, rows: FeatureRows) -> None: ...
