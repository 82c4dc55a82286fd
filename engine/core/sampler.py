"""Token sampling: greedy, temperature, top-k, top-p, min-p, with per-request random streams.

Every row is processed on its own (row-wise ops and a per-request torch.Generator), so a
request's tokens do not depend on which other requests share its batch.
"""
from __future__ import annotations

import torch

from onecat.engine.sampling_params import SamplingParams
from onecat.engine.transfers import to_device


def apply_logits_processors(logits: torch.Tensor, seqs: list) -> torch.Tensor:
    """vLLM-style per-request processors, `fn(output_token_ids, logits_row) -> logits_row`, from
    `SamplingParams.logits_processors` (grammar constraints use this). Rows without processors are
    untouched; the input tensor is never modified."""
    rows = [i for i, s in enumerate(seqs) if s.params.logits_processors]
    if not rows:
        return logits
    logits = logits.float().clone()
    for i in rows:
        for fn in seqs[i].params.logits_processors:
            logits[i] = fn(seqs[i].output_token_ids, logits[i])
    return logits


def apply_filters(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, then top-k / top-p / min-p masks -> probabilities, row by row. logits: [N, V] fp32."""
    device = logits.device
    temps = to_device([1.0 if p.greedy else p.temperature for p in params], device)
    x = logits / temps.unsqueeze(1)
    V = x.shape[-1]
    top_ks = [p.top_k if 0 < p.top_k < V else V for p in params]
    top_ps = [p.top_p for p in params]
    if any(k < V for k in top_ks) or any(p < 1.0 for p in top_ps):
        sorted_x, order = x.sort(dim=-1, descending=True)
        ks = to_device(top_ks, device)
        ranks = torch.arange(V, device=device).unsqueeze(0)
        drop = ranks >= ks.unsqueeze(1)
        if any(p < 1.0 for p in top_ps):
            probs = sorted_x.masked_fill(drop, float("-inf")).softmax(dim=-1)
            before = probs.cumsum(dim=-1) - probs  # mass strictly ahead of each token
            drop |= before > to_device(top_ps, device).unsqueeze(1)
        drop[:, 0] = False
        x = x.scatter(1, order, sorted_x.masked_fill(drop, float("-inf")))
    probs = x.softmax(dim=-1)
    if any(p.min_p > 0 for p in params):
        min_p = to_device([p.min_p for p in params], device)
        keep = probs >= min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
        probs = torch.where(keep, probs, torch.zeros_like(probs))
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def exponential_race(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """A draw from each row of `probs` [N, V], on the device (argmax p / E, E ~ Exp(1)): one draw per vocab
    entry from that row's request stream, so a row's token does not depend on the other rows."""
    noise = torch.stack([torch.empty_like(row).exponential_(generator=g) for row, g in zip(probs, generators)])
    return (probs / noise).argmax(dim=-1)


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> list[int]:
    """A token per row, read back from the device once for the whole batch."""
    logits = logits.float()
    tokens = logits.argmax(dim=-1)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:
        index = to_device(rows, logits.device)  # a list index would be copied to the device synchronously
        probs = apply_filters(logits[index], [params[i] for i in rows])
        tokens[index] = exponential_race(probs, [generators[i] for i in rows])
    return tokens.tolist()


def token_logprobs(logits: torch.Tensor, tokens: list[int], top_n: list[int | None]) -> list[dict[int, float] | None]:
    """Raw-model logprobs of each chosen token plus its row's top-n alternatives."""
    lp = logits.float().log_softmax(dim=-1)
    out: list[dict[int, float] | None] = []
    for i, (tok, n) in enumerate(zip(tokens, top_n)):
        if n is None:
            out.append(None)
            continue
        d = {tok: float(lp[i, tok])}
        if n > 0:
            vals, idx = lp[i].topk(n)
            d.update({int(t): float(v) for t, v in zip(idx.tolist(), vals.tolist())})
        out.append(d)
    return out
