"""Draft-model proposer: a smaller model with the same tokenizer, running in its own engine and KV.

Each round the draft engine continues every decoding sequence for up to k tokens. Its prefix cache
keeps the already-seen context, so a round costs the uncached tail plus k small decode steps; with the
target's cuda_graph setting those decode steps replay the draft engine's own CUDA graphs.
For sampled requests it samples with the request's settings and seed, so its draws are keyed as the
target's are (core/keyed_draws.py).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from onecat.engine.errors import ConfigError
from onecat.engine.outputs import RequestOutput
from onecat.engine.sampling_params import SamplingParams
from onecat.engine.speculative.base import Proposer


class DraftEngine(Protocol):
    """What the proposer needs of the engine that runs the draft model (an `LLM`)."""

    model_config: Any  # has vocab_size

    def engine_generate(self, token_ids: list[list[int]], params: list[SamplingParams]) -> list[RequestOutput]:
        ...

    def cuda_graph_report(self) -> dict:
        ...


OpenDraftEngine = Callable[..., DraftEngine]
"""`open_engine(model, **engine settings)`: opens the engine for the draft model (the caller passes `LLM`)."""


class DraftModelProposer(Proposer):
    name = "draft_model"

    def __init__(self, k: int, target, model: str, open_engine: OpenDraftEngine, revision: str | None = None,
                 **engine_kwargs):
        super().__init__(k)
        self.model_name = model
        self.quantization = engine_kwargs.get("quantization")  # the draft engine's, at load
        self.draft = open_engine(model, device=str(target.device), dtype=engine_kwargs.pop("dtype", target.dtype),
                                 max_model_len=target.max_model_len, max_num_seqs=target.cfg.max_num_seqs,
                                 enable_prefix_caching=True, seed=target.cfg.seed, revision=revision,
                                 cuda_graph=target.cfg.cuda_graph, **engine_kwargs)
        if self.draft.model_config.vocab_size != target.model_config.vocab_size:
            raise ConfigError(f"draft model {model!r} has vocabulary size {self.draft.model_config.vocab_size} but "
                              f"the target has {target.model_config.vocab_size}; a draft model must share the "
                              "target's tokenizer")

    def propose(self, seqs, budgets):
        # the target's seed: the draft engine draws each position with the key the target will draw it with
        # (its sequences hold the same tokens, so positions agree), and its drafts match wherever q and p agree
        params = [SamplingParams(temperature=seq.params.temperature, top_p=seq.params.top_p, top_k=seq.params.top_k,
                                 min_p=seq.params.min_p, seed=None if seq.params.greedy else seq.seed,
                                 max_tokens=budget, ignore_eos=True) for seq, budget in zip(seqs, budgets)]
        outs = self.draft.engine_generate([s.token_ids for s in seqs], params)
        return [o.token_ids for o in outs]

    def describe(self) -> dict:
        graphs = self.draft.cuda_graph_report()
        return {"method": self.name, "num_speculative_tokens": self.k, "model": self.model_name,
                "cuda_graph": {"used": graphs["used"], "replays": graphs["replays"]}, "quantization": self.quantization}
