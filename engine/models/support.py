"""What the architectures cannot run, said as errors naming the setting to change, and the settings the engine
adjusts for them (prefix caching off on hybrid models), said once in the log: the model stage of the support
matrix (engine/support_matrix), asked once the checkpoint's config names the architecture."""
from __future__ import annotations

import logging

import torch

from onecat.engine.args import EngineArgs
from onecat.engine.config import ModelConfig
from onecat.engine.support_matrix import Combination, check
from onecat.engine.support_matrix.rules import FALLBACKS_BY_NAME

log = logging.getLogger("onecat.engine")


def model_combination(cfg: EngineArgs, model: ModelConfig, device: torch.device) -> Combination:
    """The support matrix's point for these settings on this model and device."""
    return Combination.from_settings(cfg, device=device.type, architecture=model.architecture,
                                     linear_value_heads=model.raw.get("linear_num_value_heads"))


def unsupported_settings(cfg: EngineArgs, model: ModelConfig, device: torch.device) -> list[str]:
    """The refusals of the model stage: tensor parallelism beyond a hybrid model's Gated DeltaNet value heads,
    packed weights on MoE and hybrid models, DFlash on hybrid models, mamba_cache_mode without recurrent state or
    without prefix caching (engine/support_matrix/rules.py says why and what to use)."""
    return [r.message for r in check(model_combination(cfg, model, device), "model")]


def num_state_snapshots(cfg: EngineArgs) -> int:
    """State snapshots a hybrid model keeps for prefix caching (mamba_cache_mode align): one per request that may
    run at once, least recently saved replaced first."""
    return cfg.max_num_seqs if cfg.mamba_cache_mode == "align" and cfg.enable_prefix_caching else 0


def effective_settings(cfg: EngineArgs, model: ModelConfig) -> EngineArgs:
    """`cfg` as the engine runs this model: with mamba_cache_mode none a hybrid model's recurrent state (which
    summarizes the whole prefix) is not kept at block boundaries, so prefix caching is off for it."""
    point = Combination.from_settings(cfg, architecture=model.architecture)
    prefix_off = FALLBACKS_BY_NAME["hybrid-prefix-caching-off"]
    if prefix_off.holds(point):
        log.warning("%s", prefix_off.message(point))
        return cfg.model_copy(update={"enable_prefix_caching": False})
    return cfg
