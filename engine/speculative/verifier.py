"""Exact verification of one step's draft blocks, every sequence at once, on the logits' device.

Greedy: a draft token is accepted while it equals the target's argmax at its row; the target's argmax
after the accepted prefix is emitted too. Sampled: rejection sampling (accept d with probability
min(1, p(d)/q(d)); at the first rejection draw from the normalized residual max(0, p - q); a bonus token
from p when every draft is accepted) makes the emitted tokens follow the target distribution p exactly,
whatever the proposer's q. A deterministic proposer (n-gram) has q = point mass on its draft.

Acceptance, the residual and the next token are computed on the device for the whole batch; the host
reads one tensor per step (each sequence's accepted count and tokens), not one value per draft.
Every random draw comes from the request's own generator, in an order that does not depend on the
batch (len(draft) uniforms, then one uniform placed on the emitted token's law), so a seeded request's tokens
do not depend on which requests share its step.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch
from torch.nn.utils.rnn import pad_sequence

from onecat.engine.core.sampler import apply_filters, inverse_cdf
from onecat.engine.sampling_params import SamplingParams
from onecat.engine.transfers import to_device


Draft = list[int] | torch.Tensor  # a proposer's tokens: host values, or a 1-D int64 tensor on the logits' device


@dataclass(slots=True)
class DraftBlock:
    """One sequence's verify rows: `logits` [len(draft) + 1, V] of the target at the draft's positions."""

    draft: Draft
    logits: torch.Tensor
    params: SamplingParams
    generator: torch.Generator | None = None
    probs: torch.Tensor | None = None  # the proposer's q [len(draft), V]; None: point mass on each draft


def verify_blocks(blocks: list[DraftBlock]) -> list[list[int]]:
    """The tokens each block emits: its accepted drafts, then one token of the target's."""
    if not blocks:
        return []
    rows, order = verified_on_device(blocks)
    return emitted_tokens(rows.tolist(), order)  # the step's one device-to-host read


def verified_on_device(blocks: list[DraftBlock]) -> tuple[torch.Tensor, list[int]]:
    """[B, 2 + longest draft] on the device: per block its accepted count, then the tokens it emits (row i is
    block order[i]: the greedy blocks first, in order, then the sampled ones)."""
    width = max(len(b.draft) for b in blocks) + 2  # accepted count, then up to len + 1 tokens
    greedy = [i for i, b in enumerate(blocks) if b.params.greedy]
    sampled = [i for i, b in enumerate(blocks) if not b.params.greedy]
    parts = []
    if greedy:
        parts.append(_verify_greedy([blocks[i] for i in greedy]))
    if sampled:
        parts.append(_verify_sampled([blocks[i] for i in sampled]))
    return torch.cat([_pad_last(t, width) for t in parts]), greedy + sampled


def emitted_tokens(rows: list[list[int]], order: list[int]) -> list[list[int]]:
    """Each block's tokens from the rows `verified_on_device` gave, read to the host."""
    out: list[list[int]] = [[] for _ in rows]
    for i, row in zip(order, rows):
        out[i] = row[1:row[0] + 2]
    return out


def _pad_last(t: torch.Tensor, width: int) -> torch.Tensor:
    """`t` with its last dimension zero-padded to `width`."""
    return torch.nn.functional.pad(t, (0, width - t.shape[-1]))


def _padded_drafts(blocks: list[DraftBlock], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Drafts [B, K] (0 past each draft's end) and the mask of real positions [B, K]. Drafts already on the
    device are padded there (nothing is read back)."""
    k = max(len(b.draft) for b in blocks)
    if all(isinstance(b.draft, list) for b in blocks):
        drafts = to_device([b.draft + [0] * (k - len(b.draft)) for b in blocks], device, torch.long)
    else:
        drafts = pad_sequence([b.draft if isinstance(b.draft, torch.Tensor) else to_device(b.draft, device, torch.long)
                               for b in blocks], batch_first=True)
    lens = to_device([len(b.draft) for b in blocks], device)
    return drafts, torch.arange(k, device=device).unsqueeze(0) < lens.unsqueeze(1)


def _accepted_prefix(accept: torch.Tensor) -> torch.Tensor:
    """[B, K] per-position acceptance (False past a draft's end) -> accepted prefix length [B]."""
    return accept.long().cumprod(dim=1).sum(dim=1)


def _verify_greedy(blocks: list[DraftBlock]) -> torch.Tensor:
    """[B, 1 + K + 1]: accepted count, then the target's argmax at every row (the accepted drafts equal it)."""
    device = blocks[0].logits.device
    targets = pad_sequence([b.logits.argmax(dim=-1) for b in blocks], batch_first=True)  # [B, K + 1]
    drafts, real = _padded_drafts(blocks, device)
    accepted = _accepted_prefix((drafts == targets[:, :-1]) & real)
    return torch.cat([accepted.unsqueeze(1), targets], dim=1)


def _verify_sampled(blocks: list[DraftBlock]) -> torch.Tensor:
    """[B, 1 + K + 1]: accepted count, then the drafts with the target's token at the accepted count."""
    device = blocks[0].logits.device
    lens = [len(b.draft) for b in blocks]
    starts = to_device(list(accumulate((n + 1 for n in lens[:-1]), initial=0)), device)  # first rows
    p = apply_filters(torch.cat([b.logits for b in blocks]).float(),
                      [b.params for b in blocks for _ in range(len(b.draft) + 1)])  # [sum(len + 1), V]
    drafts, real = _padded_drafts(blocks, device)
    k = drafts.shape[1]
    rows = (starts.unsqueeze(1) + torch.arange(k, device=device)).clamp_max(p.shape[0] - 1)
    p_draft = p[rows, drafts]  # [B, K]: p of each draft token at its row
    q_draft = torch.stack([_pad_last(b.probs[torch.arange(n, device=device), drafts[i, :n]].float(), k)
                           if b.probs is not None else torch.ones(k, device=device)
                           for i, (b, n) in enumerate(zip(blocks, lens))])
    u = torch.stack([_pad_last(torch.rand(len(b.draft), generator=b.generator, device=device), k) for b in blocks])
    accepted = _accepted_prefix((q_draft > 0) & (u * q_draft < p_draft) & real)  # u < p/q without dividing

    p_next = p[starts + accepted]  # [B, V]: the target's distribution after the accepted prefix
    rejected = accepted < real.sum(dim=1)
    d_rejected = drafts.gather(1, accepted.clamp_max(k - 1).unsqueeze(1))  # the rejected draft token
    residual = p_next.scatter(1, d_rejected, 0.0)  # point-mass q: p without the rejected token
    with_q = [i for i, b in enumerate(blocks) if b.probs is not None]
    if with_q:
        # one-element index tensors: indexing with a 0-d device tensor would read it back to the host
        q_next = torch.cat([blocks[i].probs[accepted[i:i + 1].clamp_max(len(blocks[i].draft) - 1)].to(p.dtype)
                            for i in with_q])
        index = to_device(with_q, device)
        residual[index] = (p_next[index] - q_next).clamp_min(0.0)
    total = residual.sum(dim=1, keepdim=True)
    residual = torch.where(total > 0, residual / total.clamp_min(torch.finfo(p.dtype).tiny), p_next)
    law = torch.where(rejected.unsqueeze(1), residual, p_next)
    token = inverse_cdf(law, [b.generator for b in blocks])  # a draw from `law`

    tokens = torch.cat([drafts, drafts.new_zeros(len(blocks), 1)], dim=1).scatter(1, accepted.unsqueeze(1),
                                                                                  token.unsqueeze(1))
    return torch.cat([accepted.unsqueeze(1), tokens], dim=1)

