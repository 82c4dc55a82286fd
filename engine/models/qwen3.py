"""Qwen3: the Llama decoder with per-head RMSNorm on q and k before RoPE."""
from onecat.engine.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
