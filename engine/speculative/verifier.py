"""Exact verification of one step's draft blocks, every sequence at once, on the logits' device.

At every verify row the target's own token is drawn as plain decoding would draw it: the argmax for a greedy
request; for a sampled one, a draw keyed by the request's seed and the row's token position
(core/keyed_draws.py). A draft token is accepted while it equals that token; the target's token after the
accepted prefix is emitted too. So the emitted tokens are exactly target-only's for the seed, whatever the
proposer drafted or whether it drafted at all (drafter-invariant speculative sampling: every emitted token
follows the target distribution p because it is p's own draw); a drafter raises acceptance by drawing its
proposals with the same keys (so they match wherever its q and p agree), not by handing over q.

Drawing, the comparison and the accepted count are computed on the device for the whole batch; the host
reads one tensor per step (each sequence's accepted count and tokens), not one value per draft. A draw
depends only on its row's logits, settings and key, so a request's tokens do not depend on which requests
share its step.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn.utils.rnn import pad_sequence

from onecat.engine.core.keyed_draws import span_keys
from onecat.engine.core.sampler import greedy_on_device, sample_on_device
from onecat.engine.sampling_params import SamplingParams
from onecat.engine.transfers import to_device


Draft = list[int] | torch.Tensor  # a proposer's tokens: host values, or a 1-D int64 tensor on the logits' device


@dataclass(slots=True)
class DraftBlock:
    """One sequence's verify rows: `logits` [len(draft) + 1, V] of the target at the draft's positions; row j
    draws the token at sequence position `start` + j, keyed by the request's `seed` when it samples."""

    draft: Draft
    logits: torch.Tensor
    params: SamplingParams
    seed: int = 0
    start: int = 0


def verify_blocks(blocks: list[DraftBlock]) -> list[list[int]]:
    """The tokens each block emits: its accepted drafts, then one token of the target's."""
    if not blocks:
        return []
    return emitted_tokens(verified_on_device(blocks).tolist())  # the step's one device-to-host read


def verified_on_device(blocks: list[DraftBlock]) -> torch.Tensor:
    """[B, 2 + longest draft] on the device: per block its accepted count, then the target's token at every
    verify row (the accepted drafts equal them)."""
    device = blocks[0].logits.device
    lens = [len(b.draft) for b in blocks]
    params = [b.params for b in blocks for _ in range(len(b.draft) + 1)]
    if all(p.greedy for p in params):
        drawn = [greedy_on_device(b.logits) for b in blocks]
    else:
        keys = span_keys([(b.seed, b.start, n + 1) for b, n in zip(blocks, lens)], device)
        flat = sample_on_device(torch.cat([b.logits for b in blocks]), params, keys)
        drawn = list(flat.split([n + 1 for n in lens]))
    targets = pad_sequence(drawn, batch_first=True)  # [B, K + 1]
    drafts, real = _padded_drafts(blocks, device)
    accepted = _accepted_prefix((drafts == targets[:, :-1]) & real)
    return torch.cat([accepted.unsqueeze(1), targets], dim=1)


def emitted_tokens(rows: list[list[int]]) -> list[list[int]]:
    """Each block's tokens from the rows `verified_on_device` gave, read to the host."""
    return [row[1:row[0] + 2] for row in rows]


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
