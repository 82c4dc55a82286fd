"""The engine's support matrix: which combinations of architecture, weight format, speculative method, KV dtype,
attention backend, CUDA graphs, prefix caching, tensor parallelism and device run, declared as rules.

`check(combination)` is the one place a refusal of a combination comes from; the engine asks it at each stage
(`EngineArgs.unsupported()`, the worker's device, weights and model checks) and raises its messages, each naming
its cell: `[support matrix: qwen3_5 x nvfp4] ...`. `docs/support_matrix.md` is generated from it:

    python -m onecat.engine.support_matrix --markdown > docs/support_matrix.md

Pure data and rules: importing it loads neither torch nor pydantic.
"""
from onecat.engine.support_matrix.axes import (ARCHITECTURES, ATTENTION_BACKENDS, CHECKPOINTS, CUDA_GRAPH_MODES,
                                               DEFAULTS, DEVICES, HYBRID_ARCHITECTURES, KV_CACHE_DTYPES,
                                               MAMBA_CACHE_MODES, MOE_ARCHITECTURES, NO_CPU_KERNEL, QUANTIZATIONS,
                                               QUANTIZED_AT_LOAD, SPECULATIVE_METHODS, STAGES, UNKNOWN, Combination,
                                               example)
from onecat.engine.support_matrix.rules import (FALLBACKS, RULES, Fallback, Refusal, Rule, check, fallbacks,
                                                first_refusals, refuse)

__all__ = ["ARCHITECTURES", "ATTENTION_BACKENDS", "CHECKPOINTS", "CUDA_GRAPH_MODES", "DEFAULTS", "DEVICES",
           "HYBRID_ARCHITECTURES", "KV_CACHE_DTYPES", "MAMBA_CACHE_MODES", "MOE_ARCHITECTURES", "NO_CPU_KERNEL",
           "QUANTIZATIONS", "QUANTIZED_AT_LOAD", "SPECULATIVE_METHODS", "STAGES", "UNKNOWN", "Combination", "example", "FALLBACKS", "RULES",
           "Fallback", "Refusal", "Rule", "check", "fallbacks", "first_refusals", "refuse"]
