"""A block drafter's next round, launched before the host reads this round's verified tokens.

After a verify step, the next round of a block drafter (DFlash) depends on the step's device results alone: a
request's anchor is the bonus token at row `accepted`, at position c + accepted + 1 (c: the step's first position,
known to the host), and its new context rows are the step's first 1 + accepted tapped rows. So the drafter runs
right after the verify compare: every tapped row of the step is projected (those past the accepted ones are never
read: the context length, count + 1 + accepted, is computed on the device), the whole block is drafted, and the host
reads the verified tokens through an event recorded before that launch. On a GPU the drafter's work then overlaps
the host's post-processing and scheduling. After the read a request's accepted projected rows go into its context
cache (no second projection), and the next `propose` hands out its drafts, trimmed to its budget.

Greedy and sampled requests alike (a sampled draft is a keyed draw, core/keyed_draws.py, at the position it will
occupy, which the device knows: the anchor's plus one plus its index), drafters without a sliding window; a request
that stopped, was preempted or moved otherwise is drafted afresh. On by default where the drafter runs on a GPU (on
the H100: DFlash-shaped rounds of an 8B-shaped target 6-12% faster, docs/speculative.md); off on a CPU, where
nothing overlaps the host's work and the rejected rows' projection is pure cost. `ONECAT_DRAFT_AHEAD=0` or `=1`
overrides either way (an A/B switch). tests/test_draft_ahead.py checks its drafts against a fresh round's and its
tokens against target-only.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from onecat.engine.core.keyed_draws import keys_at, seed_key
from onecat.engine.core.sampler import greedy_on_device, sample_on_device
from onecat.engine.core.sequence import FeatureRows
from onecat.engine.speculative.dflash_cache import project_rows
from onecat.engine.switches import switch
from onecat.engine.transfers import to_device

AHEAD_FLAG = "ONECAT_DRAFT_AHEAD"


def ahead_wanted(device: torch.device) -> bool:
    """On a GPU unless `ONECAT_DRAFT_AHEAD=0`; on a CPU only with `ONECAT_DRAFT_AHEAD=1`."""
    forced = switch(AHEAD_FLAG, None)
    return device.type == "cuda" if forced is None else forced


@dataclass(slots=True)
class Ahead:
    """One request's drafts of the round after a verify step."""

    start: int  # the verify step's first position
    rows: torch.Tensor  # [layers, 2, 1 + drafts, nkv, hd]: the step's projected context rows
    drafts: torch.Tensor  # [k] int64, on the drafter's device
    logits: torch.Tensor  # [k, V] in the target's dtype (what checks compare)
    anchor: int | None = None  # the anchor's position, once the host has applied the step


class VerifiedRead:
    """The verify step's result [B, width] copied to the host behind an event: reading it waits for the verify
    compare only, not for kernels launched after it (the next round's drafter)."""

    def __init__(self, rows: torch.Tensor):
        self.event = None
        if rows.is_cuda:
            self.host = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
            self.host.copy_(rows, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = rows

    def tolist(self) -> list:
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()


@torch.inference_mode()
def draft_ahead(proposer, seqs: list, spans: list[FeatureRows], accepted: torch.Tensor,
                bonus: torch.Tensor) -> dict[str, Ahead]:
    """The next round's drafts of every sequence of a verify step, keyed by request, or {} where the step does
    not allow it (a request whose drafter context does not end where the step began). `spans`: each sequence's
    tapped rows of the step (1 + its drafts); `accepted`, `bonus`: [R] on the device."""
    cache, drafter = proposer.cache, proposer.drafter
    cache.flush()  # every row queued before this step: the contexts then end where the step began
    rids = [s.request_id for s in seqs]
    starts = [s.num_computed_tokens for s in seqs]
    if not all(cache.has_context(r) and cache.context_end(r) == c for r, c in zip(rids, starts)):
        return {}
    device = accepted.device
    widths = [s.count for s in spans]
    feats = torch.cat([s.rows() for s in spans]) if len(spans) > 1 else spans[0].rows()
    pos = to_device([c + j for c, w in zip(starts, widths) for j in range(w)], device)
    rows = cache.projector(feats, pos) if cache.projector is not None else None
    rows = rows.clone() if rows is not None else project_rows(drafter, feats.to(cache.dtype), pos)
    extra = [rows[:, :, at:at + w] for at, w in zip(itertools.accumulate(widths, initial=0), widths)]
    counts = cache.lengths(rids)
    lens = to_device(counts, device) + 1 + accepted
    first = to_device(starts, device) + 1 + accepted  # each anchor's position
    block = proposer._mask_block.repeat(len(seqs), 1)
    block[:, 0] = bonus
    block_pos = first.unsqueeze(1) + proposer._block_offsets
    h = None
    if proposer.graphs is not None:
        h = proposer.graphs.run(block, block_pos, rids, max(n + w for n, w in zip(counts, widths)), extra, lens)
    if h is None:
        h = drafter.forward_cached(proposer.embed(block), block_pos, _context_with(cache, rids, counts, extra), lens)
    k = proposer.k
    # greedy: the argmax of the target dtype's logits is that of their float32 copy (the cast is exact)
    if proposer.vocab is not None:
        proposer.vocab.round(seqs)
    logits = proposer.score(h[:, 1:1 + k].reshape(-1, h.shape[-1]))
    tokens = proposer.token_ids(greedy_on_device(logits)).view(len(seqs), k)
    sampled = [r for r, s in enumerate(seqs) if not s.params.greedy]
    if sampled:  # keyed as a fresh round keys them: draft j sits at the anchor's position + 1 + j
        index = to_device(sampled, device)
        positions = (first[index].unsqueeze(1) + 1 + torch.arange(k, device=device)).reshape(-1)
        keys = keys_at(to_device([seed_key(seqs[r].seed) for r in sampled], device).repeat_interleave(k), positions)
        rows = logits.view(len(seqs), k, -1)[index].reshape(len(sampled) * k, -1).float()
        rows = rows if proposer.vocab is None else proposer.vocab.widen(rows)
        tokens[index] = sample_on_device(rows, [seqs[r].params for r in sampled for _ in range(k)],
                                         keys).view(len(sampled), k)
    return {rid: Ahead(c, ext, tokens[r], logits[r * k:(r + 1) * k])
            for r, (rid, c, ext) in enumerate(zip(rids, starts, extra))}


def _context_with(cache, request_ids: list[str], counts: list[int],
                  extra: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per drafter layer (keys, values) [R, C, nkv, hd]: each request's held context (`counts` rows), then its
    `extra` rows."""
    C = max(n + e.shape[2] for n, e in zip(counts, extra))
    layers, two, nkv, hd = cache.row_shape
    buf = torch.zeros(layers, two, len(request_ids), C, nkv, hd, dtype=cache.dtype, device=cache.device)
    cache.copy_into(request_ids, buf)
    for r, (n, e) in enumerate(zip(counts, extra)):
        buf[:, :, r, n:n + e.shape[2]] = e
    return [(buf[layer, 0], buf[layer, 1]) for layer in range(layers)]


def kept_from_ahead(proposer, seq, start: int, count: int) -> bool:
    """Store a request's kept rows of a verify step from the projection its drafted-ahead round made (True), or
    drop that round (False: the rows are queued as usual)."""
    ahead = proposer.ahead.get(seq.request_id)
    if ahead is not None and ahead.start == start and count <= ahead.rows.shape[2]:
        proposer.cache.store(seq.request_id, start, ahead.rows[:, :, :count])
        ahead.anchor = seq.num_computed_tokens
        return True
    proposer.ahead.pop(seq.request_id, None)
    return False


def propose_with_ahead(proposer, seqs, budgets, fresh) -> list:
    """`propose`: the drafts drafted ahead for requests whose anchor is where that round put it, trimmed to their
    budgets; `fresh(seqs, budgets)` drafts the others. Rounds drafted ahead and not handed out now are dropped."""
    ahead, proposer.ahead = proposer.ahead, {}
    found = {i: ahead.get(s.request_id) for i, s in enumerate(seqs)}
    ready = {i: a for i, a in found.items() if a is not None and a.anchor == seqs[i].num_tokens - 1}
    if not ready:
        return fresh(seqs, budgets)
    proposer.ahead_served += len(ready)
    out = [None] * len(seqs)
    for i, a in ready.items():
        draft = a.drafts[:min(budgets[i], proposer.k)]
        out[i] = draft if proposer.drafts_on_device else draft.tolist()
    rest = [i for i in range(len(seqs)) if i not in ready]
    if rest:
        for i, drafted in zip(rest, fresh([seqs[i] for i in rest], [budgets[i] for i in rest])):
            out[i] = drafted
    return out
