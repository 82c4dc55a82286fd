"""Exact verification of a draft block: greedy prefix match, or rejection sampling for sampled decoding.

Rejection sampling (accept d with prob min(1, p(d)/q(d)); on rejection draw from the normalized
residual max(0, p - q); a bonus token from p when every draft is accepted) makes the emitted tokens
follow the target distribution p exactly, whatever the proposer's q. A deterministic proposer
(n-gram) has q = point mass on its draft. Random draws come from the request's own generator.
"""
from __future__ import annotations

import torch

from onecat.engine.core.sampler import apply_filters, sample_from_probs
from onecat.engine.sampling_params import SamplingParams


def verify_greedy(draft: list[int], target: list[int]) -> list[int]:
    """target: the target's argmax at each of the len(draft) + 1 verify rows. Longest prefix of the draft
    equal to it, then the target's next token."""
    a = 0
    while a < len(draft) and draft[a] == target[a]:
        a += 1
    return draft[:a] + [target[a]]


def verify_sampled(draft: list[int], draft_probs: torch.Tensor | None, logits: torch.Tensor,
                   params: SamplingParams, generator: torch.Generator | None) -> list[int]:
    k = len(draft)
    p = apply_filters(logits.float(), [params] * (k + 1))  # target distributions, same filters as plain sampling
    out: list[int] = []
    for j, d in enumerate(draft):
        q_d = 1.0 if draft_probs is None else float(draft_probs[j, d])
        u = float(torch.rand((), generator=generator, device=p.device))
        if q_d > 0 and u * q_d < float(p[j, d]):  # u < p/q without dividing by a tiny q
            out.append(d)
            continue
        if draft_probs is None:
            residual = p[j].clone()
            residual[d] = 0.0
        else:
            residual = (p[j] - draft_probs[j].to(p.dtype)).clamp_min(0.0)
        total = residual.sum()
        residual = p[j] if float(total) <= 0 else residual / total
        out.append(sample_from_probs(residual, generator))
        return out
    out.append(sample_from_probs(p[k], generator))
    return out
