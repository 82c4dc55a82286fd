"""Speculative decoding: proposers (ngram, draft_model, dflash, mtp, synthetic) and one exact verifier."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

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
        quantized = {} if spec.quantization is None else {"quantization": spec.quantization}  # the draft engine's
        proposer = DraftModelProposer(k, target, spec.model, open_engine=open_draft_engine, revision=spec.revision,
                                      **dtype, **quantized)
    elif spec.method == "synthetic":
        proposer = _synthetic(spec, target)
    elif spec.method == "mtp":
        from onecat.engine.speculative.mtp import MTPProposer

        proposer = MTPProposer(k, target, spec.draft_vocab_size)  # the checkpoint's own head: no drafter or dtype
    else:
        from onecat.engine.speculative.dflash import DFlashProposer

        dtype = None if spec.dtype == "auto" else getattr(torch, spec.dtype)  # auto: the target's
        proposer = DFlashProposer(k, target, spec.model, revision=spec.revision, dtype=dtype,
                                  draft_vocab_size=spec.draft_vocab_size, quantization=spec.quantization)
    return SpeculativeDecoder(proposer, target.max_model_len, SpeculationGate(enabled=spec.disable_when_slower))


def _synthetic(spec: SpeculativeConfig, target) -> Proposer:
    """Acceptance set by construction over a real drafter's compute (synthetic.py); it learns each prompt's
    greedy continuation from the requests that finish with it."""
    from onecat.engine.speculative.ngram import NgramProposer
    from onecat.engine.speculative.synthetic import LearnedContinuations, SyntheticProposer

    k = spec.num_speculative_tokens
    if spec.compute == "dflash":
        from onecat.engine.speculative.dflash import DFlashProposer
        from onecat.engine.speculative.random_drafter import random_dflash_drafter

        n = spec.draft_vocab_size  # a random drafter ranks no tokens: its drafts are replaced, the head's size counts
        compute: Proposer = DFlashProposer(k, target, str(random_dflash_drafter(target.model_config, k + 1)),
                                           draft_vocab_size=n, draft_ids=None if n is None else (
                                               list(range(target.model_config.vocab_size)), "synthetic: ids in order"),
                                           quantization=spec.quantization)
    elif spec.compute == "mtp":
        from onecat.engine.speculative.mtp import MTPProposer

        n = spec.draft_vocab_size  # a random head ranks no tokens: its drafts are replaced, the head's size counts
        compute = MTPProposer(k, target, n, None if n is None else (list(range(target.model_config.vocab_size)),
                                                                     "synthetic: ids in order"))
    else:
        compute = NgramProposer(k)
    return SyntheticProposer(compute, spec.acceptance_length - 1, LearnedContinuations(),
                             target.model_config.vocab_size)
