"""Maps an HF `architectures` entry to the model class that runs it."""
from __future__ import annotations

from onecat.engine.errors import UnsupportedModelError

_ARCHS = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama",
          "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}


def architecture_of(cfg: dict) -> str:
    names = cfg.get("architectures") or []
    for n in names:
        if n in _ARCHS:
            return _ARCHS[n]
    raise UnsupportedModelError(
        f"model architecture {names or cfg.get('model_type')!r} is not supported; supported: "
        f"{', '.join(sorted(_ARCHS))}")


def model_class(arch: str):
    from onecat.engine.models.llama import LlamaForCausalLM
    from onecat.engine.models.qwen2 import Qwen2ForCausalLM
    from onecat.engine.models.qwen3 import Qwen3ForCausalLM

    return {"llama": LlamaForCausalLM, "qwen2": Qwen2ForCausalLM, "qwen3": Qwen3ForCausalLM}[arch]
