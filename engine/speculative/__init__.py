"""Speculative decoding: proposers (ngram, draft_model, dflash) and one exact verifier."""
from __future__ import annotations

from typing import TYPE_CHECKING

from onecat.engine.args import NGRAM_ONLY, SpeculativeConfig
from onecat.engine.speculative.base import Proposer, SpeculativeDecoder
from onecat.engine.speculative.controller import SpeculationGate

if TYPE_CHECKING:
    from onecat.engine.speculative.draft_model import OpenDraftEngine


def build_proposer(spec: SpeculativeConfig, target, open_draft_engine: OpenDraftEngine) -> SpeculativeDecoder:
    """The decoder for `spec` (validated when it was made: engine/args.py) over `target`, the worker that
    holds the target model. `open_draft_engine(model, **settings)` opens the draft model's engine (method
    draft_model)."""
    k = spec.num_speculative_tokens
    if spec.method == "ngram":
        from onecat.engine.speculative.ngram import NgramProposer

        lookup = {name: getattr(spec, name) for name in NGRAM_ONLY if getattr(spec, name) is not None}
        proposer: Proposer = NgramProposer(k, **lookup)  # model-free: dtype/revision do not apply
    elif spec.method == "draft_model":
        from onecat.engine.speculative.draft_model import DraftModelProposer

        dtype = {} if spec.dtype == "auto" else {"dtype": spec.dtype}  # auto: the target's
        proposer = DraftModelProposer(k, target, spec.model, open_engine=open_draft_engine, revision=spec.revision,
                                      **dtype)
    else:
        from onecat.engine.speculative.dflash import DFlashProposer

        proposer = DFlashProposer(k, target, spec.model, revision=spec.revision)
    return SpeculativeDecoder(proposer, target.max_model_len, SpeculationGate(enabled=spec.disable_when_slower))
