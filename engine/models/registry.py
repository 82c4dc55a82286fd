"""Maps an architecture name (`ModelConfig.architecture`, from config.architecture_of) to the model
class that runs it."""
from __future__ import annotations


def model_class(arch: str):
    from onecat.engine.models.llama import LlamaForCausalLM
    from onecat.engine.models.qwen2 import Qwen2ForCausalLM
    from onecat.engine.models.qwen3 import Qwen3ForCausalLM
    from onecat.engine.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM
    from onecat.engine.models.qwen3_moe import Qwen3MoeForCausalLM

    return {"llama": LlamaForCausalLM, "qwen2": Qwen2ForCausalLM, "qwen3": Qwen3ForCausalLM,
            "qwen3_moe": Qwen3MoeForCausalLM, "qwen3_5": Qwen3_5ForCausalLM,
            "qwen3_5_moe": Qwen3_5MoeForCausalLM}[arch]
