"""Engine adapters: one interface over the in-process engine, vLLM and OpenAI-compatible endpoints.

An adapter class is registered with `@register_engine("name")` and provides:

    takes_engine_args: bool                True when engine.options are onecat EngineArgs settings
                                           (contract check validates them)
    check(arm: ArmSettings) -> list[str]   classmethod, cheap, loads nothing: a list of problems
                                           (missing model files, backend not available...) with
                                           where it looked, so `gate run` fails before any loading
    open(arm: ArmSettings, seed: int) -> adapter instance      classmethod

and the instance offers (the `Engine` protocol, which is what runners are given):
    generate(prompts, params) -> list[RequestOutput]     (onecat.engine.outputs); params: one SamplingParams
                                                         for every prompt, or a list with one per prompt
    chat(conversations, params) -> list[RequestOutput]   the arm's reasoning setting (ArmSettings.reasoning)
                                                         reaches the chat template of every conversation
    score(prompts) -> list[ScoreOutput]
    tokenizer          (encode / decode / eos_token_ids)
    vocab_size         int | None
    info() -> dict     effective settings (fast paths actually used), stored with the run
    failure() -> dict | None   None while the engine can serve; once its server process has died: how
                       (`cause`, `exit_code`) and its last output (`output_tail`)
    close()
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, Union

from onecat.engine.sampling_params import SamplingParams
from onecat.gates.contract import ArmSettings

if TYPE_CHECKING:
    from onecat.engine.outputs import RequestOutput, ScoreOutput

PromptParams = Union[SamplingParams, list[SamplingParams]]  # one for every prompt, or one per prompt


class Engine(Protocol):
    """An open engine as runners drive it. Every EngineAdapter is one, and so is any object with these members
    (a test's fake engine)."""

    tokenizer: Any  # encode / decode / eos_token_ids; the backend's own class
    vocab_size: int | None

    def generate(self, prompts: list, params: PromptParams) -> list[RequestOutput]: ...
    def chat(self, conversations: list, params: PromptParams) -> list[RequestOutput]: ...
    def score(self, prompts: list) -> list[ScoreOutput]: ...
    def info(self) -> dict: ...
    def close(self) -> None: ...


class EngineUnavailableError(RuntimeError):
    """The arm cannot run here (backend missing, model absent...); the message says what and where."""


class EngineDiedError(EngineUnavailableError):
    """The engine's server was started and died (or never got ready): `failure` says how, as
    EngineAdapter.failure() does: {"cause": "killed by SIGSEGV (-11) before it was ready", "exit_code": -11,
    "output_tail": its last output}."""

    def __init__(self, message: str, failure: dict):
        super().__init__(message)
        self.failure = failure


class EngineAdapter:
    """The base of the registered backends: an Engine, plus the class-level `check` / `open` that gate_run calls."""

    name: str = "?"
    takes_engine_args = False
    tokenizer: Any = None
    vocab_size: int | None = None

    @classmethod
    def check(cls, arm: ArmSettings) -> list[str]:
        return []

    @classmethod
    def open(cls, arm: ArmSettings, seed: int = 0) -> "EngineAdapter":
        raise NotImplementedError

    def generate(self, prompts: list, params: PromptParams) -> list[RequestOutput]:
        raise NotImplementedError

    def chat(self, conversations: list, params: PromptParams) -> list[RequestOutput]:
        raise NotImplementedError

    def score(self, prompts: list) -> list[ScoreOutput]:
        raise NotImplementedError

    def info(self) -> dict:
        return {}

    def failure(self) -> dict | None:
        return None  # an in-process engine has no server that can die on its own

    def close(self) -> None:
        pass


def open_engine(arm: ArmSettings, seed: int = 0) -> EngineAdapter:
    from onecat.gates.registry import ENGINES, lookup

    lookup(ENGINES, "engine backend", arm.engine.backend)
    problems = ENGINES[arm.engine.backend].check(arm)
    if problems:
        raise EngineUnavailableError(f"arm {arm.name}: " + "; ".join(problems))
    return ENGINES[arm.engine.backend].open(arm, seed)
