"""Speculative decoding: proposers (ngram, draft_model, dflash) and one exact verifier."""
from __future__ import annotations

from typing import TYPE_CHECKING

from onecat.engine.errors import ConfigError
from onecat.engine.speculative.base import Proposer, SpeculativeDecoder

if TYPE_CHECKING:
    from onecat.engine.speculative.draft_model import OpenDraftEngine

METHODS = ("ngram", "draft_model", "dflash")


def build_proposer(config: dict, target, open_draft_engine: OpenDraftEngine) -> SpeculativeDecoder:
    """`config` uses vLLM's speculative_config names: method, num_speculative_tokens, model, ...
    `open_draft_engine(model, **settings)` opens the draft model's engine (method draft_model)."""
    cfg = {k: v for k, v in config.items() if v is not None}
    method = cfg.pop("method", None)
    dtype = cfg.pop("dtype", "auto")
    revision = cfg.pop("revision", None)
    k = cfg.pop("num_speculative_tokens", None)
    if method not in METHODS:
        raise ConfigError(f"speculative method {method!r} is not supported; choose one of {', '.join(METHODS)}")
    if not isinstance(k, int) or k < 1:
        raise ConfigError(f"speculative num_speculative_tokens={k!r}; must be a positive integer")
    try:
        if method == "ngram":
            from onecat.engine.speculative.ngram import NgramProposer

            proposer: Proposer = NgramProposer(k, **cfg)  # model-free: dtype/revision do not apply
        elif method == "draft_model":
            from onecat.engine.speculative.draft_model import DraftModelProposer

            if "model" not in cfg:
                raise ConfigError("speculative method draft_model needs `model` (path or name of the draft model)")
            if dtype != "auto":
                cfg["dtype"] = dtype
            proposer = DraftModelProposer(k, target, open_engine=open_draft_engine, revision=revision, **cfg)
        else:
            from onecat.engine.speculative.dflash import DFlashProposer

            proposer = DFlashProposer(k, target, revision=revision, **cfg)
    except TypeError as e:
        raise ConfigError(f"bad speculative_config for method {method}: {e}") from None
    return SpeculativeDecoder(proposer, target.max_model_len)
