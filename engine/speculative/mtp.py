"""Method mtp: the checkpoint's own multi-token-prediction head (models/qwen3_5_mtp.py) drafts k tokens.

The head reads the target's last hidden state after its final norm; the target taps it (HiddenStateTap, the
output of its last layer, before the final norm) and this proposer applies the target's final norm. Every
computed position i the target keeps is recorded with the token after it, t_{i+1}; the head's keys/values of
those positions are kept per request in the drafter KV cache (dflash_cache.py), projected for all
requests at once before drafting.

The features are formed for all queued requests at once before drafting (a step's requests in one embedding,
one norm and one concatenation). A round, for every decoding request at once: the first query is the newest kept position p (its input is
(h_p, t_{p+1}) and its keys/values are in the cache already); draft j + 1 feeds the head its own output
and draft j at position p + j, attending over the kept positions and the earlier draft rows (those rows
are the round's only: the next recording replaces them with the target's). Greedy requests draft the
argmax; sampled ones draw from q = the filtered softmax of the head's logits with the keys the target will
draw each position with (core/keyed_draws.py), so a draft matches the target's token wherever q and p agree.
With the target on full CUDA graphs, rounds replay the head's graphs (mtp_graphs.py), greedy or sampled.

With `draft_vocab_size`, every draft step scores the head's output over N ranked token ids instead of the target's
whole LM head (draft_vocab.py), which is most of a round's bytes on a large-vocabulary target with few active
weights (Qwen3.5-35B-A3B: a 248K x 2048 head, 1 GB of bf16, read at each of k draft steps, against ~2.4 GB a
target step). The ids are ranked in the checkpoint's directory (`draft_vocab.json`, `onecat drafter vocab`) and
stay the same every round (a round's own tokens are not added, as a DFlash drafter's are: the drafting loop is
one CUDA graph, whose buffers are fixed); a step's logits outside them are -inf, so the argmax and the keyed draws
pick target token ids as before and the verifier keeps the target's law.
"""
from __future__ import annotations

import itertools

import torch

from onecat.engine.core.keyed_draws import span_keys
from onecat.engine.core.sampler import greedy_on_device
from onecat.engine.core.sequence import FeatureRows
from onecat.engine.speculative.base import Proposer, drafts_stay_on_device, hidden_state_tap
from onecat.engine.speculative.dflash_cache import FLUSH_ROWS, DrafterKVCache
from onecat.engine.speculative.draft_vocab import DraftVocab, ranked_ids
from onecat.engine.speculative.mtp_graphs import MTPGraphs, keyed_pick
from onecat.engine.speculative.mtp_weights import load_mtp_head
from onecat.engine.speculative.round_graphs import describe_graphs, open_graphs
from onecat.engine.transfers import to_device


class MTPProposer(Proposer):
    name = "mtp"

    def __init__(self, k: int, target, draft_vocab_size: int | None = None,
                 draft_ids: tuple[list[int], str] | None = None):
        """`draft_vocab_size`: score drafts over that many of the ids ranked in the target checkpoint's directory
        (`draft_ids`: (ids, their source) given instead)."""
        super().__init__(k)
        model = target.model
        cfg = target.model_config
        self.head = load_mtp_head(cfg, type(model).make_mlp, target.source, target.cfg.load_format, target.cfg.seed,
                                  target.max_model_len + k, target.dtype, target.device)
        self.embed, self.lm_head = target.vocab_layers()
        self.vocab = None
        if draft_vocab_size is not None:
            folder = target.source.path if target.source.path.is_dir() else target.source.path.parent
            self.vocab = DraftVocab.first(self.lm_head, draft_ids or ranked_ids(folder), draft_vocab_size,
                                          cfg.vocab_size)
            self.lm_head = RankedHead(self.vocab)  # what every draft step scores with, eager and in the graphs
        self.final_norm = model.norm
        self.tap = hidden_state_tap(model)
        self.tap.aux_layer_ids = [cfg.num_hidden_layers - 1]
        self.cache = DrafterKVCache(self.head)
        self.target = target
        self.graphs, self.graphs_off_reason = None, None
        if target.device.type == "cuda" and getattr(target.cfg, "cuda_graph", "off") == "full":
            self.graphs, self.graphs_off_reason = open_graphs(
                lambda: MTPGraphs(self.head, self.embed, self.lm_head, self.cache, 2 * cfg.hidden_size, target.device,
                                  max_steps=k),
                "the MTP graphs'")
        self.newest: dict[str, tuple[int, torch.Tensor]] = {}  # request -> (its newest kept position, its features)
        # (request, first position, the step's rows, the token after each), queued until _flush_features
        self.pending: list[tuple[str, int, FeatureRows, list[int]]] = []
        self.pending_rows = 0

    def record_features(self, seq, rows: FeatureRows) -> None:
        """`rows`: the tapped hidden states of the positions the step just kept, ending at num_computed_tokens;
        the token after each is known by now (the prompt's, or the step's output). Queued with those tokens: the
        head's inputs of every request are formed at once before drafting (_flush_features), not ~10 small
        kernels a request a step."""
        if rows.count == 0:
            return
        start = seq.num_computed_tokens - rows.count
        self.pending.append((seq.request_id, start, rows, seq.token_ids[start + 1:start + rows.count + 1]))
        self.pending_rows += rows.count
        if self.pending_rows >= FLUSH_ROWS:  # a long prefill, or a batch decoding a while without drafts
            self._flush_features()

    @torch.inference_mode()
    def _flush_features(self) -> None:
        """Every queued row's head input (embedding of the token after it, the row after the target's final
        norm) in one pass over all requests, then each request's rows into the drafter cache and its newest
        one kept."""
        if not self.pending:
            return
        pending, self.pending, self.pending_rows = self.pending, [], 0
        rows = torch.cat([r.rows() for _, _, r, _ in pending]) if len(pending) > 1 else pending[0][2].rows()
        nxt = to_device([t for *_, after in pending for t in after], rows.device)
        features = torch.cat([self.embed(nxt), self.final_norm(rows.to(self.cache.dtype))], dim=-1)
        ends = list(itertools.accumulate(r.count for _, _, r, _ in pending))
        newest = features[to_device([e - 1 for e in ends], rows.device)]  # their own tensor: no view of all rows
        for i, (request_id, start, r, _) in enumerate(pending):
            self.cache.add(request_id, start, features[ends[i] - r.count:ends[i]])
            self.newest[request_id] = (start + r.count - 1, newest[i])

    def _ready(self, seq) -> bool:
        """The request's newest kept position is the one before its last token (the state of a decoding request
        whose every computed position was recorded)."""
        newest = self.newest.get(seq.request_id)
        return newest is not None and newest[0] == seq.num_tokens - 2 and self.cache.has_context(seq.request_id) \
            and self.cache.context_end(seq.request_id) == seq.num_tokens - 1

    @property
    def drafts_on_device(self) -> bool:
        return drafts_stay_on_device(self.target)

    @torch.inference_mode()
    def propose(self, seqs, budgets):
        self._flush_features()
        self.cache.flush()
        counts = [min(b, self.k) if self._ready(s) else 0 for s, b in zip(seqs, budgets)]
        rows = [i for i, n in enumerate(counts) if n]
        if not rows:
            return [[]] * len(seqs)
        picked = [seqs[i] for i in rows]
        tokens = self._draft(picked, max(counts))
        out: list = [[]] * len(seqs)
        for r, i in enumerate(rows):
            out[i] = tokens[r][:counts[i]]
        return out

    def _draft(self, seqs, steps: int):
        """`steps` drafts for each request (a sampled one's drawn with the keys the target will draw them with)."""
        device = self.cache.device
        request_ids, params = [s.request_id for s in seqs], [s.params for s in seqs]
        last_positions = [s.num_tokens - 2 for s in seqs]
        newest = torch.stack([self.newest[r][1] for r in request_ids])
        sampled = [r for r, p in enumerate(params) if not p.greedy]
        tokens = None
        if self.graphs is not None:
            tokens = self.graphs.run(request_ids, newest, last_positions, steps, max(self.cache.lengths(request_ids)),
                                     seqs, sampled)
        if tokens is None:
            layer_kv, ctx_len = self.cache.gather(request_ids)
            (k_ctx, v_ctx), = layer_kv
            visible = torch.arange(k_ctx.shape[1], device=device) < ctx_len.unsqueeze(1)
            pick = greedy_on_device
            if sampled:  # the sampled rows as a device index (a list index copies in sync), their drafts' keys
                keys = span_keys([(seqs[r].seed, seqs[r].num_tokens, steps) for r in sampled], device)
                pick = keyed_pick(to_device(sampled, device), [params[r] for r in sampled],
                                  keys.view(len(sampled), steps))
            tokens = self.head.draft(self.embed, self.lm_head, self.head.context(newest),
                                     to_device(last_positions, device), k_ctx, v_ctx, visible, steps, pick)
        if not self.drafts_on_device:
            tokens = tokens.tolist()  # every draft of every request, read back at once
        return tokens

    def release(self, seq) -> None:
        self.pending = [p for p in self.pending if p[0] != seq.request_id]  # its queued rows are of no use now
        self.pending_rows = sum(p[2].count for p in self.pending)
        self.cache.release(seq.request_id)
        self.newest.pop(seq.request_id, None)

    def describe(self) -> dict:
        return {"method": self.name, "num_speculative_tokens": self.k, "proposer": "the checkpoint's mtp.* head",
                "hidden_state_of_layer": self.tap.aux_layer_ids[0],
                **describe_graphs(self.graphs, self.graphs_off_reason),
                "draft_vocab": None if self.vocab is None else {**self.vocab.describe(), "plus": None}}


class RankedHead(torch.nn.Module):
    """The target's LM head as a draft step sees it with a draft vocabulary: logits over the ranked ids, -inf at
    every other token id (so a pick over them returns target ids). Its tensors never change: CUDA-graph safe."""

    def __init__(self, vocab: DraftVocab):
        super().__init__()
        self.vocab = vocab

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.vocab.widen(self.vocab.head(hidden))
