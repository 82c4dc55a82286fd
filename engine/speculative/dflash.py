"""The DFlash proposer: drafts for every decoding request in one call of a DFlash block drafter
(dflash_model.py: the architecture and its loading), on the target's tapped features, through CUDA graphs and
the fused kernels on a GPU, drafting the next round ahead where it can (draft_ahead.py)."""
from __future__ import annotations

import itertools

import torch
from torch import nn

from onecat.engine.core.keyed_draws import span_keys
from onecat.engine.core.sampler import greedy_on_device, sample_on_device
from onecat.engine.core.sequence import FeatureRows
from onecat.engine.errors import ConfigError
from onecat.engine.model_source import resolve_model_source
from onecat.engine.speculative.base import Proposer, drafts_stay_on_device, hidden_state_tap
from onecat.engine.speculative.dflash_cache import DrafterKVCache
from onecat.engine.speculative.dflash_fused import FUSED_FLAG
from onecat.engine.speculative.dflash_graphs import DrafterGraphs, graphs_wanted
from onecat.engine.speculative.dflash_model import load_drafter
from onecat.engine.speculative.draft_ahead import (Ahead, ahead_wanted, draft_ahead, kept_from_ahead,
                                                  propose_with_ahead)
from onecat.engine.speculative.draft_vocab import DraftVocab, ranked_ids
from onecat.engine.speculative.drafter_quant import quantize_drafter
from onecat.engine.speculative.round_graphs import describe_graphs, open_graphs
from onecat.engine.switches import switch
from onecat.engine.transfers import to_device
from onecat.engine.worker.fused_kernels import enable_fused_kernels


class _CastOutput(nn.Module):
    """A module whose output is cast to `dtype` (the target's embedding feeding a drafter of another dtype)."""

    def __init__(self, inner: nn.Module, dtype: torch.dtype):
        super().__init__()
        self.inner, self.dtype = inner, dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x).to(self.dtype)


class DFlashProposer(Proposer):
    """Drafts for every decoding request in one drafter call: the requests' blocks are stacked, their
    contexts (the drafter KV cache, dflash_cache.py) padded to the longest and masked by length.

    Every block is the whole trained block [last token, MASK x (block_size - 1)] whatever a request's
    budget: the drafter is trained on whole blocks (mask rows attend to each other, so fewer of them
    would change every draft), and one shape serves every round. A request with budget n keeps the
    first n drafts; only those rows go through the target's lm_head."""

    name = "dflash"
    trims_drafts = True

    def __init__(self, k: int, target, model: str, revision: str | None = None, dtype: torch.dtype | None = None,
                 draft_vocab_size: int | None = None, draft_ids: tuple[list[int], str] | None = None,
                 quantization: str | None = None):
        """`dtype`: the drafter's (None: the target's). Another than the target's meets it at three casts: the
        embeddings of a block, the tapped features (the context cache casts them) and the hidden states the
        target's LM head reads. `draft_vocab_size`: score drafts over that many of the drafter's ranked token
        ids (draft_vocab.py; `draft_ids`: (ids, their source) given instead of the folder's file). `quantization`:
        the drafter's linears quantized at load in that format (drafter_quant.py)."""
        source = resolve_model_source(model, revision)
        if source.format != "hf":
            raise ConfigError(f"DFlash drafter {model!r} resolved to a {source.format} file ({source.path}); a "
                              "drafter is a directory with config.json and model.safetensors")
        self.drafter = load_drafter(source.path, target, dtype or target.dtype, target.device)
        self.quantization = None if quantization is None else quantize_drafter(self.drafter, quantization)
        super().__init__(min(k, self.drafter.block_size - 1))
        self.model_name = model
        self.target = target
        embed, self.lm_head = target.vocab_layers()  # whole even when the target is sharded (TP)
        self.vocab = None if draft_vocab_size is None else DraftVocab.first(
            self.lm_head, draft_ids or ranked_ids(source.path), draft_vocab_size, target.model_config.vocab_size)
        self.dtype, self.target_dtype = self.drafter.norm.weight.dtype, target.dtype
        self.embed = embed if self.dtype == target.dtype else _CastOutput(embed, self.dtype)
        self.tap = hidden_state_tap(target.model)
        self.tap.aux_layer_ids = list(self.drafter.target_layer_ids)
        self.cache = DrafterKVCache(self.drafter)
        self.ahead: dict[str, Ahead] = {}  # the next round's drafts, launched before a verify step was read
        self._ahead_on = (ahead_wanted(target.device) and self.drafter.sliding_window is None
                          and not target.has_peer_ranks)
        self.ahead_served = 0  # requests' rounds whose drafts were drafted ahead
        device = target.device
        # the target's fused-kernel choice (Triton on a GPU, the C++ ops on a CPU): drafting through dflash_fused.py
        enable_fused_kernels(self.drafter, device, self.dtype, switch(FUSED_FLAG, True) and
                             bool((getattr(target, "fused_kernels", None) or {}).get("used")))
        self._block_offsets = torch.arange(self.drafter.block_size, device=device)
        self._mask_block = torch.full((1, self.drafter.block_size), self.drafter.mask_token_id, device=device)
        self.graphs, self.graphs_off_reason = None, None
        if graphs_wanted(device, getattr(target.cfg, "cuda_graph", "off") == "full"):
            self.graphs, self.graphs_off_reason = open_graphs(
                lambda: DrafterGraphs(self.drafter, self.embed, self.cache, device), "the drafter graphs'")
            if self.graphs is not None:
                with torch.inference_mode():
                    self.graphs.capture_ahead(target.cfg.max_num_seqs, target.max_model_len)

    @property
    def drafts_on_device(self) -> bool:
        return drafts_stay_on_device(self.target)

    @property
    def drafts_ahead(self) -> bool:
        """Whether verify steps launch the next round's drafter before their tokens are read (draft_ahead.py)."""
        return self._ahead_on

    def draft_ahead(self, seqs, spans: list[FeatureRows], accepted: torch.Tensor, bonus: torch.Tensor) -> None:
        self.ahead = draft_ahead(self, seqs, spans, accepted, bonus)

    def record_features(self, seq, rows: FeatureRows) -> None:
        """`rows` are the features of the positions the step just computed: they end at num_computed_tokens. Rows
        a round drafted ahead already projected are stored as they are."""
        start = seq.num_computed_tokens - rows.count
        if not kept_from_ahead(self, seq, start, rows.count):
            self.cache.add(seq.request_id, start, rows, prompt=start < seq.num_prompt_tokens)

    @torch.inference_mode()
    def draft_logits(self, seqs, budgets) -> tuple[torch.Tensor | None, list[int]]:
        """The drafter's logits for every draft of every sequence, [sum of counts, V] float32, and each
        sequence's count (its budget, capped at k; 0 for a sequence without context yet)."""
        self.cache.flush()
        counts = [min(b, self.k) if self.cache.has_context(s.request_id) else 0 for s, b in zip(seqs, budgets)]
        rows = [i for i, n in enumerate(counts) if n]
        if not rows:
            return None, counts
        device = self._mask_block.device
        anchors = to_device([[seqs[i].token_ids[-1], seqs[i].num_tokens - 1] for i in rows], device)
        block = self._mask_block.repeat(len(rows), 1)
        block[:, 0] = anchors[:, 0]
        h = self._block_hidden(block, anchors[:, 1:] + self._block_offsets, [seqs[i].request_id for i in rows])
        if self.vocab is not None:
            self.vocab.round([seqs[i] for i in rows])
        wanted = [counts[i] for i in rows]
        if min(wanted) == max(wanted):
            picked = h[:, 1:1 + wanted[0]].reshape(-1, h.shape[-1])
        else:
            B = self.drafter.block_size
            index = [r * B + 1 + j for r, n in enumerate(wanted) for j in range(n)]
            picked = h.view(-1, h.shape[-1])[to_device(index, device)]
        return self.score(picked).float(), counts

    def score(self, hidden: torch.Tensor) -> torch.Tensor:
        """The drafts' logits from the drafter's outputs: over the target's vocabulary, or the draft vocabulary."""
        head = self.lm_head if self.vocab is None else self.vocab
        return head(hidden.to(self.target_dtype))

    def token_ids(self, picked: torch.Tensor) -> torch.Tensor:
        """Positions in `score`'s logits -> the target's token ids."""
        return picked if self.vocab is None else self.vocab.token_ids(picked)

    def _block_hidden(self, block: torch.Tensor, block_pos: torch.Tensor, request_ids: list[str]) -> torch.Tensor:
        """The drafter's [R, block_size, H] output for the blocks, by CUDA graph replay when one fits."""
        if self.graphs is not None:
            h = self.graphs.run(block, block_pos, request_ids, max(self.cache.lengths(request_ids)))
            if h is not None:
                return h
        layer_kv, ctx_len = self.cache.gather(request_ids)
        return self.drafter.forward_cached(self.embed(block), block_pos, layer_kv, ctx_len)

    @torch.inference_mode()
    def propose(self, seqs, budgets):
        return propose_with_ahead(self, seqs, budgets, self._propose)

    def _propose(self, seqs, budgets):
        logits, counts = self.draft_logits(seqs, budgets)
        if logits is None:
            return [[]] * len(seqs)
        starts = list(itertools.accumulate(counts, initial=0))
        tokens = self.token_ids(greedy_on_device(logits))
        sampled = [i for i, (s, n) in enumerate(zip(seqs, counts)) if n and not s.params.greedy]
        if sampled:  # drawn as the target will draw each position (keyed_draws.py): equal wherever q and p agree
            rows = to_device([r for i in sampled for r in range(starts[i], starts[i + 1])], logits.device)
            q = logits[rows] if self.vocab is None else self.vocab.widen(logits[rows])
            keys = span_keys([(seqs[i].seed, seqs[i].num_tokens, counts[i]) for i in sampled], logits.device)
            tokens[rows] = sample_on_device(q, [seqs[i].params for i in sampled for _ in range(counts[i])], keys)
        if not self.drafts_on_device:
            tokens = tokens.tolist()  # the drafts of every sequence, read back at once
        return [tokens[starts[i]:starts[i + 1]] for i in range(len(seqs))]

    def release(self, seq) -> None:
        self.cache.release(seq.request_id)
        self.ahead.pop(seq.request_id, None)
        if self.vocab is not None:
            self.vocab.forget(seq.request_id)

    def defer_context(self, paused: bool) -> None:
        self.cache.defer = paused

    @property
    def one_off_work(self) -> int:
        """Graphs captured and prompts' rows projected (a request's first flush holds its whole prompt)."""
        return self.graph_captures + self.cache.prompt_flushes

    def describe(self) -> dict:
        return {"method": self.name, "num_speculative_tokens": self.k, "model": self.model_name,
                "block_size": self.drafter.block_size, "target_layer_ids": self.drafter.target_layer_ids,
                "sliding_window": self.drafter.sliding_window, **describe_graphs(self.graphs, self.graphs_off_reason),
                **({"cuda_graph_context_projections": self.graphs.flush_replays} if self.graphs is not None else {}),
                "fused_kernels": self.drafter.norm.use_fused or self.drafter.norm.cpu_ops is not None,
                "dtype": str(self.dtype).removeprefix("torch."),
                "drafts_ahead": self._ahead_on, "rounds_drafted_ahead": self.ahead_served,
                "context": {"prompt_flushes": self.cache.prompt_flushes,
                            "queue_compactions_while_paused": self.cache.compactions},
                "draft_vocab": self.vocab.describe() if self.vocab is not None else None,
                "quantization": self.quantization}
