"""Maps an architecture name (`ModelConfig.architecture`, from config.architecture_of) to the model
class that runs it."""
from __future__ import annotations


def model_class(arch: str):
    from onecat.engine.models.llama import LlamaForCausalLM
    from onecat.engine.models.qwen2 import Qwen2ForCausalLM
    from onecat.engine.models.qwen3 import Qwen3ForCausalLM

    return {"llama": LlamaForCausalLM, "qwen2": Qwen2ForCausalLM, "qwen3": Qwen3ForCausalLM}[arch]
