"""onecat inference engine: `from onecat.engine import LLM, SamplingParams`."""
from onecat.engine.outputs import RequestOutput, ScoreOutput
from onecat.engine.sampling_params import InvalidRequestError, SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "ScoreOutput", "InvalidRequestError"]


def __getattr__(name):  # keep `import onecat.engine` light: torch models load only when LLM is used
    if name == "LLM":
        from onecat.engine.llm import LLM

        return LLM
    raise AttributeError(name)
