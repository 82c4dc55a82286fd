"""Qwen2: the Llama decoder with biases on the q/k/v projections (set from the config)."""
from onecat.engine.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    qk_norm = False
