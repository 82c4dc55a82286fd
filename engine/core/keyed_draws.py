"""Random draws keyed by (request seed, token position): a sampled token is a function of the distribution it
is drawn from, the request's seed and the token's index in the sequence, and of nothing else.

So a draw does not depend on what ran before it: not on how many draws a drafter, a verify step or an
earlier round made, nor on which step computed the position. That makes speculation drafter-invariant:
the verifier draws the target's token at every verify row with the same key plain decoding would use,
accepts a draft while it equals that token, and so emits exactly the tokens target-only sampling emits for
the seed, whatever the proposer, its acceptance, or whether the gate let it draft (Daliri, Musco and
Suresh, "Coupling without communication and drafter-invariant speculative decoding", 2024). A drafter
draws its own proposals with the same keys, which couples them to the target's draws: a proposal equals
the target's token more often the closer the two distributions are.

Two rules, chosen by the row's settings alone:
  - candidates (top-k / top-p rows: their kept ids): Gumbel-max, argmax of log p + G(key, token id), the
    noise keyed by token id, so two distributions over different candidate sets still share it per token;
  - the whole vocabulary in id order (no top-k / top-p): one keyed uniform placed on the cumulative sum
    (one random number a row rather than one per vocabulary entry).

The hash is 32-bit xorshift-multiply mixing written with int64 tensor ops whose products never pass 2^63, so the
same code runs on Python ints and on CPU and CUDA tensors, with the same values; each token id's hash is a table
per vocabulary, so a draw over candidates is a gather and one mixing round.
"""
from __future__ import annotations

import functools

import torch

from onecat.engine.transfers import to_device

_M32 = 0xFFFFFFFF
_WHOLE_LANE = 0x9E3779B9  # the lane of the whole-vocabulary rule's single uniform (no token id has it)


def _mix(x):
    """A 32-bit to 32-bit bijection that spreads every input bit over the output (C. Wellons' hash-prospector
    xorshift-multiply form, multipliers below 2^31: a product of a 32-bit value never passes 2^63, so int64
    tensors and Python ints compute the same value)."""
    x = x ^ (x >> 16)
    x = (x * 0x21F0AAAD) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x735A2D97) & _M32
    return x ^ (x >> 15)


def seed_key(seed: int) -> int:
    """The 32-bit key of a request's seed (any non-negative int below 2^64), before its position is mixed in."""
    return _mix(_mix((seed >> 32) & _M32 ^ 0x5EED5EED) ^ (seed & _M32))


def row_key(seed: int, position: int) -> int:
    """The 32-bit key of the token at `position` (its index in the sequence, prompt included) of a request
    seeded with `seed`."""
    return _mix(seed_key(seed) ^ (position & _M32))


def keys_at(seed_keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """row_key on the device, for positions known only there: `seed_keys` (seed_key of each row's seed) and
    `positions`, both int64 of one shape."""
    return _mix(seed_keys ^ (positions & _M32))


def row_keys(seeds: list[int], positions: list[int], device: torch.device | str) -> torch.Tensor:
    """Keys [N] int64 on `device` for rows (seed, position), computed on the host and queued in one copy."""
    return to_device([row_key(s, p) for s, p in zip(seeds, positions)], device, torch.int64)


def span_keys(spans: list[tuple[int, int, int]], device: torch.device | str) -> torch.Tensor:
    """row_keys of consecutive positions: for each (seed, first position, count), the keys of positions
    first .. first + count - 1, all spans concatenated (a verify block's rows, a drafter's drafts)."""
    return row_keys([seed for seed, _, n in spans for _ in range(n)],
                    [first + j for _, first, n in spans for j in range(n)], device)


@functools.lru_cache(maxsize=8)
def _lane_hashes(vocab_size: int, device: torch.device) -> torch.Tensor:
    """_mix of every token id, made once per vocabulary and device (a gather a draw instead of ~20 kernels)."""
    with torch.inference_mode(False):  # a normal tensor: callers outside inference mode (autograd) use it too
        return _mix(torch.arange(vocab_size, dtype=torch.int64, device=device))


def uniforms(keys: torch.Tensor, lanes: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Keyed uniforms in (0, 1), float64, shape of `lanes` [N, C] (token ids below `vocab_size`), one key per row
    (`keys` [N])."""
    h = _mix(keys.unsqueeze(1) ^ _lane_hashes(vocab_size, keys.device)[lanes])
    return (h.double() + 0.5) * 2.0 ** -32


def draw(probs: torch.Tensor, ids: torch.Tensor | None, keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """One index into each row of `probs` [N, C], on the device: over candidates `ids` [N, C] (their token ids,
    below `vocab_size`) by keyed Gumbel-max, or over the whole vocabulary in id order (`ids` None) by a keyed
    uniform on the cumulative sum. Only entries of positive probability are drawn."""
    if ids is None:
        u = (_mix(keys ^ _mix(_WHOLE_LANE)).double() + 0.5) * 2.0 ** -32
        cdf = probs.double().cumsum(dim=-1)
        total = cdf[:, -1]
        # below the total, the first entry whose cumulative sum passes the point is one where the sum grew
        point = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
        return torch.searchsorted(cdf, point.unsqueeze(1), right=True).squeeze(1)
    gumbel = -torch.log(-torch.log(uniforms(keys, ids, vocab_size)))
    score = torch.where(probs > 0, probs.double().log() + gumbel, float("-inf"))
    return score.argmax(dim=-1)
