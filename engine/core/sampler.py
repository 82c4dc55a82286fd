"""Token sampling: greedy, temperature, top-k, top-p, min-p, each draw keyed by (request seed, position).

Every row is processed on its own (row-wise ops and a keyed draw, keyed_draws.py), so a request's tokens
do not depend on which other requests share its batch, nor on which step or speculative round drew them.
"""
from __future__ import annotations

import functools

import torch

from onecat.engine.core.keyed_draws import draw
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


@functools.lru_cache(maxsize=4096)
def _constant(values: tuple, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    with torch.inference_mode(False):  # a normal tensor: callers outside inference mode (autograd) use it too
        return to_device(list(values), device, dtype)


def constant(values, device: torch.device, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """A row setting or row index list as a `dtype` tensor on `device`, made once per distinct value and device:
    a steady batch's sampling steps then copy nothing to the device, and a captured sampling step
    (sampler_graphs.py) reads tensors that outlive it. Never written to."""
    return _constant(tuple(values), torch.device(device), dtype)


CANDIDATES = 1024  # a row's nucleus is looked for among its this-many largest logits first


def apply_filters(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, then top-k / top-p / min-p masks -> probabilities over the vocabulary, row by row.
    logits: [N, V] fp32."""
    out = None
    for rows, probs, ids in filtered(logits, params):
        if ids is None and len(rows) == logits.shape[0]:
            return probs
        if out is None:
            out = logits.new_zeros(logits.shape)
        index = constant(rows, logits.device)
        out[index] = probs if ids is None else probs.new_zeros(len(rows), logits.shape[1]).scatter_(1, ids, probs)
    return out


def filtered(logits: torch.Tensor, params: list[SamplingParams], sort_top_p: bool | None = None
             ) -> list[tuple[list[int], torch.Tensor, torch.Tensor | None]]:
    """Each row's sampling distribution after temperature, top-k, top-p and min-p, in groups of rows:
    (rows, probabilities [len(rows), C], their token ids [len(rows), C], or None when C is the whole
    vocabulary in id order). A row that keeps its top k or nucleus gets its CANDIDATES (or top_k) largest
    logits, selected without sorting the vocabulary (the sort was most of a sampled step at batch 256 on a
    CPU); only a row whose candidates hold less than its top_p of the mass is sorted whole, which the host
    decides from the logits (a read-back). `sort_top_p` (default: on a GPU) sorts every row with top-p and no
    top-k whole instead: no read-back, so the pipeline and its graphs (sampler_graphs.py) never wait for
    the host, at a sort a GPU does in microseconds; the kept tokens and their keyed draws are the same. Which
    group a row lands in depends on its own logits and settings alone, so its tokens do not depend on its batch."""
    V = logits.shape[-1]
    device = logits.device
    temps = constant([1.0 if p.greedy else p.temperature for p in params], device, torch.float32)
    x = logits / temps.unsqueeze(1)
    top_ks = [p.top_k if 0 < p.top_k < V else V for p in params]
    cut = [i for i, p in enumerate(params) if top_ks[i] < V or p.top_p < 1.0]  # rows with a top-k or nucleus
    groups = []
    whole = [i for i in range(len(params)) if top_ks[i] == V and params[i].top_p >= 1.0]
    if whole:  # every token stays: the whole vocabulary in id order
        xs = x if not cut else x[constant(whole, device)]
        groups.append((whole, _min_p(xs.softmax(dim=-1), [params[i] for i in whole]), None))
    if not cut:
        return groups
    xc = x if not whole else x[constant(cut, device)]
    pc, kc = [params[i] for i in cut], [top_ks[i] for i in cut]
    short = [j for j in range(len(cut)) if kc[j] >= V] if (device.type == "cuda" if sort_top_p is None
                                                            else sort_top_p) else []
    fits = [j for j in range(len(cut)) if j not in short]
    if fits:
        xf = xc if not short else xc[constant(fits, device)]
        kf, pf = [kc[j] for j in fits], [pc[j] for j in fits]
        width = min(V, max([CANDIDATES] + [k for k in kf if k < V]))
        vals, ids = xf.topk(width, dim=-1)  # largest first
        probs, past = _nucleus(xf, vals, kf, pf)
        if past:  # rows whose nucleus may reach past their candidates join the sorted ones
            keep = constant([j for j in range(len(fits)) if j not in past], device)
            probs, ids = probs[keep], ids[keep]
            short = sorted(short + [fits[j] for j in past])
            fits = [j for j in fits if j not in short]
        if fits:
            groups.append(([cut[j] for j in fits], _min_p(probs, [pc[j] for j in fits]), ids))
    if short:  # every token may be in the nucleus: sort the whole vocabulary
        index = constant(short, device)
        vals, ids = xc[index].sort(dim=-1, descending=True)
        sub = [pc[j] for j in short]
        probs, _ = _nucleus(xc[index], vals, [kc[j] for j in short], sub)
        groups.append(([cut[j] for j in short], _min_p(probs, sub), ids))
    return groups


def _nucleus(x: torch.Tensor, vals: torch.Tensor, top_ks: list[int], params: list[SamplingParams]
             ) -> tuple[torch.Tensor, list[int]]:
    """Probabilities over each row's largest logits `vals` [N, C] (descending) after its top-k and top-p, and the
    rows whose top-p nucleus may reach past the C candidates (top_k not set and the candidates' mass within
    top_p). A token is dropped when the mass strictly ahead of it exceeds top_p (the first is always kept)."""
    device = x.device
    V, C = x.shape[-1], vals.shape[-1]
    drop = torch.arange(C, device=device).unsqueeze(0) >= constant(top_ks, device).unsqueeze(1)
    short: list[int] = []
    top_ps = [p.top_p for p in params]
    if any(p < 1.0 for p in top_ps):
        whole = [i for i, k in enumerate(top_ks) if k >= V]  # top-k not set: mass over the whole vocabulary
        if len(whole) == len(top_ks):
            log_total = x.logsumexp(dim=-1)
        else:
            log_total = vals.masked_fill(drop, float("-inf")).logsumexp(dim=-1)
            if whole:
                index = constant(whole, device)
                log_total[index] = x[index].logsumexp(dim=-1)
        probs = (vals - log_total.unsqueeze(1)).exp().masked_fill(drop, 0.0)
        before = probs.cumsum(dim=-1) - probs  # mass strictly ahead of each token
        ps = constant(top_ps, device, torch.float32).unsqueeze(1)
        drop |= (before > ps) & (ps < 1.0)  # a row without top_p keeps its top k (cumsum may round past 1)
        if C < V and whole:  # the token after the last candidate is kept unless the candidates' mass > top_p
            reach = (before[:, -1] + probs[:, -1] <= ps[:, 0]).tolist()
            short = [i for i in whole if reach[i] and top_ps[i] < 1.0]
    drop[:, 0] = False
    return vals.masked_fill(drop, float("-inf")).softmax(dim=-1), short


def _min_p(probs: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Drop tokens below min_p x the row's most likely token's probability, and renormalize."""
    if not any(p.min_p > 0 for p in params):
        return probs
    min_p = constant([p.min_p for p in params], probs.device, torch.float32)
    keep = probs >= min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
    probs = torch.where(keep, probs, torch.zeros_like(probs))
    return probs / probs.sum(dim=-1, keepdim=True)


def greedy_on_device(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax [N] int64 (first index on ties), left on the device: on a GPU by the two-stage Triton
    kernels that plain greedy decoding takes (torch's generic reduction spent ~35 us on a DFlash round's 15 x 128K
    float16 draft logits and ~27 us on a verify step's 8 rows), else argmax_cpu."""
    if logits.is_cuda and logits.dim() == 2:
        from onecat.engine.kernels.triton_support import fused_unavailable_reason

        if fused_unavailable_reason() is None:
            from onecat.engine.kernels.triton_fused import argmax_rows

            return argmax_rows(logits)
    return argmax_cpu(logits)


def argmax_cpu(logits: torch.Tensor) -> torch.Tensor:
    """torch.argmax(dim=-1): a CPU tensor's float32 rows by the CPU ops' row-parallel vector argmax where they are
    built (torch's reduction walked a 16 x 49152 step's logits in ~1 ms on a 2-core Xeon, a tenth of a decode
    step's matmuls), else torch's."""
    if logits.device.type == "cpu" and logits.dim() == 2 and logits.dtype == torch.float32 and logits.shape[1] > 0:
        from onecat.engine.kernels import cpu_ops

        if cpu_ops.unavailable_reason() is None:
            return cpu_ops.load().argmax_rows(logits.contiguous())
    return logits.argmax(dim=-1)


def sample_on_device(logits: torch.Tensor, params: list[SamplingParams], keys: torch.Tensor | None) -> torch.Tensor:
    """A token per row [N] int64, left on the device: the argmax for a greedy row; for a sampled one a draw
    keyed by its (seed, position) key in `keys` [N] (keyed_draws.py) over the candidates its filters keep (or
    the whole vocabulary when it keeps that). On a GPU nothing is read back; on a CPU a row with top-p
    without top-k reads whether its nucleus reaches past its candidates (filtered())."""
    logits = logits.float()
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if len(rows) < len(params):
        tokens = argmax_cpu(logits)
    else:
        tokens = torch.empty(len(params), dtype=torch.int64, device=logits.device)
    if rows:
        assert keys is not None, "sampled rows need their (seed, position) keys"
        index = constant(rows, logits.device)  # a list index would be copied to the device synchronously
        sub, sub_keys = (logits, keys) if len(rows) == len(params) else (logits[index], keys[index])
        for group, probs, ids in filtered(sub, [params[i] for i in rows]):
            at = constant(group, logits.device) if len(group) < len(rows) else None
            picked = draw(probs, ids, sub_keys if at is None else sub_keys[at], logits.shape[-1])
            if ids is not None:
                picked = ids.gather(1, picked.unsqueeze(1)).squeeze(1)
            tokens[constant([rows[j] for j in group], logits.device)] = picked
    return tokens


def sample(logits: torch.Tensor, params: list[SamplingParams], keys: torch.Tensor | None) -> list[int]:
    """sample_on_device's tokens, read back from the device once for the whole batch."""
    return sample_on_device(logits, params, keys).tolist()


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
