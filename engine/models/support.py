"""What the MoE and hybrid architectures cannot run yet, said as errors naming the setting to change, and the
settings the engine adjusts for them (prefix caching off on hybrid models), said once in the log."""
from __future__ import annotations

import logging

import torch

from onecat.engine.args import EngineArgs
from onecat.engine.config import HYBRID_ARCHITECTURES, ModelConfig

log = logging.getLogger("onecat.engine")

MOE_ARCHITECTURES = ("qwen3_moe", "qwen3_5_moe")


def unsupported_settings(cfg: EngineArgs, model: ModelConfig, device: torch.device) -> list[str]:
    arch = model.architecture
    hybrid = arch in HYBRID_ARCHITECTURES
    out = []
    if cfg.mamba_cache_mode != "none" and not hybrid:
        out.append(f"mamba_cache_mode={cfg.mamba_cache_mode!r} saves the recurrent state of hybrid models; {arch} "
                   "has none: use mamba_cache_mode none")
    if arch not in MOE_ARCHITECTURES + HYBRID_ARCHITECTURES:
        return out
    kind = "hybrid (linear + full attention)" if hybrid else "MoE"
    # tensor parallel: MoE experts shard by intermediate units, Gated DeltaNet by heads (engine/parallel); a rank
    # needs at least one DeltaNet value head (a key head serving several is replicated and its value heads split)
    world, v_heads = cfg.tensor_parallel_size, model.raw.get("linear_num_value_heads")
    if hybrid and world > 1 and v_heads and world > v_heads:
        out.append(f"tensor_parallel_size={world} exceeds the {v_heads} Gated DeltaNet value heads of {arch} "
                   f"(linear_num_value_heads): every rank needs at least one; use tensor_parallel_size <= {v_heads}")
    # cuda_graph full runs on both kinds: MoE routing, the expert sort and the fused kernels run from device
    # tensors, and a hybrid decode step takes its state slots from the graph's static buffer (cuda_graph.py)
    if cfg.quantization is not None:
        out.append(f"quantization {cfg.quantization!r} is not implemented for {kind} models ({arch}); run the "
                   "checkpoint unquantized")
    spec = cfg.speculative_config
    if hybrid and spec is not None and spec.method == "dflash":
        out.append(f"speculative method dflash on hybrid models ({arch}) is not implemented: the DFlash drafter "
                   "reads hidden states of the target's layers that hybrid models do not tap; use ngram or "
                   "draft_model")
    if cfg.mamba_cache_mode == "align" and hybrid and not cfg.enable_prefix_caching:
        out.append("mamba_cache_mode='align' saves recurrent states for prefix caching, which is off: set "
                   "enable_prefix_caching true, or use mamba_cache_mode none")
    return out


def num_state_snapshots(cfg: EngineArgs) -> int:
    """State snapshots a hybrid model keeps for prefix caching (mamba_cache_mode align): one per request that may
    run at once, least recently saved replaced first."""
    return cfg.max_num_seqs if cfg.mamba_cache_mode == "align" and cfg.enable_prefix_caching else 0


def effective_settings(cfg: EngineArgs, model: ModelConfig) -> EngineArgs:
    """`cfg` as the engine runs this model: with mamba_cache_mode none a hybrid model's recurrent state (which
    summarizes the whole prefix) is not kept at block boundaries, so prefix caching is off for it."""
    if model.architecture in HYBRID_ARCHITECTURES and cfg.enable_prefix_caching and cfg.mamba_cache_mode == "none":
        log.warning("prefix caching is off for the hybrid model %s (mamba_cache_mode none: the recurrent state is "
                    "not kept per block)", model.architecture)
        return cfg.model_copy(update={"enable_prefix_caching": False})
    return cfg
