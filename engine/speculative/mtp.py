"""Method mtp: the checkpoint's own multi-token-prediction head (models/qwen3_5_mtp.py) drafts k tokens.

The head reads the target's last hidden state after its final norm; the target taps it (HiddenStateTap, the
output of its last layer, before the final norm) and this proposer applies the target's final norm. Every
computed position i the target keeps is recorded with the token after it, t_{i+1}; the head's keys/values of
those positions are kept per request in the drafter KV cache (dflash_cache.py), projected for all
requests at once before drafting.

A round, for every decoding request at once: the first query is the newest kept position p (its input is
(h_p, t_{p+1}) and its keys/values are in the cache already); draft j + 1 feeds the head its own output
and draft j at position p + j, attending over the kept positions and the earlier draft rows (those rows
are the round's only: the next recording replaces them with the target's). Greedy requests draft the
argmax; sampled ones draw from q = the filtered softmax of the head's logits with the keys the target will
draw each position with (core/keyed_draws.py), so a draft matches the target's token wherever q and p agree.
With the target on full CUDA graphs, rounds replay the head's graphs (mtp_graphs.py), greedy or sampled.
"""
from __future__ import annotations

import torch

from onecat.engine.core.keyed_draws import row_keys
from onecat.engine.core.sampler import sample_on_device
from onecat.engine.core.sequence import FeatureRows
from onecat.engine.speculative.base import Proposer, drafts_stay_on_device, hidden_state_tap
from onecat.engine.speculative.dflash_cache import DrafterKVCache
from onecat.engine.speculative.mtp_graphs import MTPGraphs
from onecat.engine.speculative.mtp_weights import load_mtp_head
from onecat.engine.speculative.round_graphs import describe_graphs, open_graphs
from onecat.engine.transfers import to_device


class MTPProposer(Proposer):
    name = "mtp"

    def __init__(self, k: int, target):
        super().__init__(k)
        model = target.model
        cfg = target.model_config
        self.head = load_mtp_head(cfg, type(model).make_mlp, target.source, target.cfg.load_format, target.cfg.seed,
                                  target.max_model_len + k, target.dtype, target.device)
        self.embed, self.lm_head = target.vocab_layers()
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

    @torch.inference_mode()
    def record_features(self, seq, rows: FeatureRows) -> None:
        """`rows`: the tapped hidden states of the positions the step just kept, ending at num_computed_tokens;
        the token after each is known by now (the prompt's, or the step's output)."""
        if rows.count == 0:
            return
        rows = rows.rows()
        end = seq.num_computed_tokens
        start = end - rows.shape[0]
        nxt = to_device(seq.token_ids[start + 1:end + 1], rows.device)
        features = torch.cat([self.embed(nxt), self.final_norm(rows.to(self.cache.dtype))], dim=-1)
        self.cache.add(seq.request_id, start, features)
        self.newest[seq.request_id] = (end - 1, features[-1].clone())  # not a view that keeps all the rows

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
            picked = to_device(sampled, device)  # the sampled rows as a device index (a list index copies in sync)

            step = iter(range(steps))

            def pick(logits: torch.Tensor) -> torch.Tensor:  # called once per draft step, in order
                token = logits.argmax(dim=-1)
                if sampled:
                    j = next(step)
                    keys = row_keys([seqs[r].seed for r in sampled], [seqs[r].num_tokens + j for r in sampled],
                                    device)
                    token[picked] = sample_on_device(logits[picked], [params[r] for r in sampled], keys)
                return token

            tokens = self.head.draft(self.embed, self.lm_head, self.head.context(newest),
                                     to_device(last_positions, device), k_ctx, v_ctx, visible, steps, pick)
        if not self.drafts_on_device:
            tokens = tokens.tolist()  # every draft of every request, read back at once
        return tokens

    def release(self, seq) -> None:
        self.cache.release(seq.request_id)
        self.newest.pop(seq.request_id, None)

    def describe(self) -> dict:
        return {"method": self.name, "num_speculative_tokens": self.k, "proposer": "the checkpoint's mtp.* head",
                "hidden_state_of_layer": self.tap.aux_layer_ids[0],
                **describe_graphs(self.graphs, self.graphs_off_reason)}
