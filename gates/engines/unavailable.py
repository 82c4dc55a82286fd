"""Backends named in the design (vLLM in-process, OpenAI-compatible endpoints) that this build does
not drive yet: registered so contracts may name them, and refused with a clear message at run time."""
from onecat.gates.contract import ArmSettings
from onecat.gates.engines.base import EngineAdapter, EngineUnavailableError
from onecat.gates.registry import register_engine


class _NotInThisBuild(EngineAdapter):
    @classmethod
    def check(cls, arm: ArmSettings) -> list[str]:
        return [f"engine backend {cls.registry_name!r} is not available in this build yet; "
                "use `engine: {backend: onecat}`"]

    @classmethod
    def open(cls, arm: ArmSettings, seed: int = 0) -> EngineAdapter:
        raise EngineUnavailableError(cls.check(arm)[0])


@register_engine("vllm")
class VllmEngine(_NotInThisBuild):
    pass

