"""Per-request decoding settings, declared once and validated up front so bad values never reach torch.

`SamplingParams` is the one declaration of a sampling setting: its name, type, default, help and
allowed values (`Bounds`). The server's request bodies (engine/server/protocol.py) and the gate
contract's `sampling` block (gates/contract/settings.py) take their fields' bounds and help from it
through `setting(name)`, and may only narrow them; engine/server/sampling_body.py converts between
request bodies and SamplingParams.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import MISSING, dataclass, field, fields
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # `import onecat.engine` stays light: no torch until an engine is built
    import torch


GREEDY_BELOW = 1e-5  # vLLM's sampling epsilon: smaller temperatures overflow the logits, so they mean greedy


class InvalidRequestError(ValueError):
    """A request (prompt or sampling settings) that the engine refuses, with what to change."""


@dataclass(frozen=True)
class Bounds:
    """The values a numeric setting allows. SamplingParams.validate checks them; the pydantic models that carry
    the setting take `constraints()` as their field's constraints (they refuse infinities and NaN as they read
    numbers, so `finite` is checked here only)."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    finite: bool = False
    fix: str = ""  # what the refusal tells the caller to send instead

    def holds(self, value: Any) -> bool:
        return ((self.ge is None or value >= self.ge) and (self.gt is None or value > self.gt)
                and (self.le is None or value <= self.le) and (self.lt is None or value < self.lt)
                and (not self.finite or math.isfinite(value)))

    def constraints(self) -> dict[str, float]:
        """pydantic `Field` keyword arguments (ge, gt, le, lt) of these bounds."""
        return {k: v for k, v in (("ge", self.ge), ("gt", self.gt), ("le", self.le), ("lt", self.lt)) if v is not None}


def _setting(default: Any = MISSING, help: str = "", bounds: Bounds | None = None, **kw: Any) -> Any:
    """A SamplingParams field with its help and bounds (read back through `setting(name)`)."""
    return field(default=default, metadata={"help": help, "bounds": bounds or Bounds()}, **kw)


@dataclass
class SamplingParams:
    """vLLM-compatible sampling settings. temperature == 0 means greedy."""

    n: int = _setting(1, "sequences per request: the engine samples one (submit n requests for n samples)")
    temperature: float = _setting(
        1.0, f"0: greedy decoding (so is any value below {GREEDY_BELOW:g}); higher: sample from a flatter distribution",
        Bounds(ge=0.0, finite=True, fix="use 0 for greedy or a positive finite number"))
    top_p: float = _setting(1.0, "nucleus sampling: keep the likeliest tokens whose probabilities sum to top_p; 1: off",
                            Bounds(gt=0.0, le=1.0, fix="must be in (0, 1]"))
    top_k: int = _setting(0, "keep the k likeliest tokens; 0 or -1: off",
                          Bounds(ge=-1, fix="use 0 or -1 to disable, or a positive integer"))
    min_p: float = _setting(0.0, "drop tokens less likely than min_p times the likeliest one; 0: off",
                            Bounds(ge=0.0, le=1.0, fix="must be in [0, 1]"))
    seed: int | None = _setting(None, "seed of this request's sampling; unset: the engine's seed",
                                Bounds(ge=0, lt=2**63, fix="must be a non-negative 63-bit integer"))
    max_tokens: int | None = _setting(16, "tokens generated at most (the cap; reaching it finishes with 'length')",
                                      Bounds(ge=0, fix="must be >= 0 (0 only with prompt_logprobs)"))
    min_tokens: int = _setting(0, "tokens generated before EOS or a stop may end the generation",
                               Bounds(ge=0, fix="must be in [0, max_tokens]"))
    stop: list[str] | str | None = _setting(None, "strings that end the generation (not included in the text)")
    stop_token_ids: list[int] | None = _setting(None, "token ids that end the generation")
    ignore_eos: bool = _setting(False, "keep generating past EOS, up to max_tokens")
    include_stop_str_in_output: bool = _setting(False, "keep the matched stop string in the text")
    logprobs: int | None = _setting(None, "top-n logprobs per generated token (the sampled token always included)",
                                    Bounds(ge=0, fix="must be >= 0"))
    prompt_logprobs: int | None = _setting(
        None, "0: the logprob of each prompt token given its prefix; N: also the N likeliest",
        Bounds(ge=0, fix="must be >= 0"))
    skip_special_tokens: bool = _setting(True, "leave special tokens out of the text")
    # vLLM's per-request `fn(output_token_ids, logits_row) -> logits_row`, run on the request's logits
    # row before sampling (grammar constraints). Usually stateful: dataclasses.replace() shares them,
    # and == compares them by identity.
    logits_processors: list[Callable[[list[int], torch.Tensor], torch.Tensor]] = _setting(
        help="functions fn(output_token_ids, logits_row) -> logits_row run before sampling",
        default_factory=list)
    keep_probs: bool = _setting(False, "hand back each step's sampling distribution (after temperature and the filters)")

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

    def _within_bounds(self, name: str, unset_allowed: bool = False) -> None:
        value = getattr(self, name)
        if not (unset_allowed and value is None) and not _BOUNDS[name].holds(value):
            raise _invalid(f"{name}={value}; {_BOUNDS[name].fix}")

    def validate(self) -> None:
        if self.n != 1:
            raise _invalid(f"n={self.n}; the engine generates one sequence per request (submit n requests)")
        for name in ("temperature", "top_p", "top_k", "min_p"):
            self._within_bounds(name)
        self._within_bounds("max_tokens", unset_allowed=True)
        if self.max_tokens == 0 and self.prompt_logprobs is None:
            raise _invalid("max_tokens=0 generates nothing; set prompt_logprobs to score the prompt")
        self._within_bounds("min_tokens")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise _invalid(f"min_tokens={self.min_tokens}; {_BOUNDS['min_tokens'].fix}")
        for name in ("logprobs", "prompt_logprobs", "seed"):
            self._within_bounds(name, unset_allowed=True)
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise _invalid(f"stop={self.stop!r}; stop strings must be non-empty strings")
        if any(not callable(fn) for fn in self.logits_processors):
            raise _invalid(f"logits_processors={self.logits_processors!r}; each must be a callable "
                           "fn(output_token_ids, logits_row) -> logits_row")
        if not isinstance(self.keep_probs, bool):
            raise _invalid(f"keep_probs={self.keep_probs!r}; must be True or False")


def _invalid(what: str) -> InvalidRequestError:
    return InvalidRequestError(f"invalid sampling parameter: {what}")


@dataclass(frozen=True)
class Setting:
    """One SamplingParams setting as declared: what other schemas that carry it derive their field from."""

    name: str
    type: Any
    default: Any
    help: str
    bounds: Bounds


_FIELDS = {f.name: f for f in fields(SamplingParams)}
_BOUNDS: dict[str, Bounds] = {name: f.metadata["bounds"] for name, f in _FIELDS.items()}


def setting(name: str) -> Setting:
    """The declaration of SamplingParams' setting `name` (its type evaluated here: annotations are text, and
    only this one's is read, so torch stays unimported)."""
    f = _FIELDS[name]
    default = f.default_factory() if f.default_factory is not MISSING else f.default
    return Setting(name=name, type=eval(f.type, globals()), default=default, help=f.metadata["help"],  # noqa: S307
                   bounds=f.metadata["bounds"])
