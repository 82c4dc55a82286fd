"""A DFlash drafter's draft vocabulary (`speculative_config.draft_vocab_size`): drafts scored over the N token ids
the target writes most often instead of over the target's whole LM head (EAGLE-3's draft vocabulary).

Every draft reads the LM head once per round for its rows, and on a small target or a large vocabulary that is
a large share of the round (SmolLM2-135M: 49,152 x 576, as many bytes as the packed target; Qwen3.5-27B: 248K x
5120, 2.5 GB of bf16 a round). The ids come ranked from the drafter's folder (`draft_vocab.json`, written by
training/draft_vocab.py from the target's own answers), and each round adds its requests' own tokens (a
prompt's names and numbers: the drafts a drafter gets right most often, by copying). Exactness does not depend
on them: the verifier draws the target's own
token from its whole vocabulary at every row, and a draft outside the ids is never proposed (an early
rejection at most); a sampled draft is drawn by target token id with the target's keys (core/keyed_draws.py).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from onecat.engine.errors import ConfigError
from onecat.engine.layers.batch_invariant_linear import dense_weight
from onecat.engine.layers.linear import Linear, pack_weights
from onecat.engine.transfers import to_device

DRAFT_VOCAB_FILE = "draft_vocab.json"


def ranked_ids(folder: Path) -> tuple[list[int], str]:
    """The drafter folder's ranked token ids, most frequent first, and where they came from."""
    path = Path(folder) / DRAFT_VOCAB_FILE
    if not path.is_file():
        raise ConfigError(f"draft_vocab_size needs the drafter's ranked vocabulary {path}, which does not exist: "
                          f"write it with `onecat drafter vocab --target TARGET --out {path}` or leave "
                          "draft_vocab_size unset")
    try:
        record = json.loads(path.read_text())
        ids = [int(i) for i in record["ids"]]
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"{path} is not a draft vocabulary (a JSON object whose `ids` lists token ids): {exc}") \
            from None
    return ids, f"{DRAFT_VOCAB_FILE} ({record.get('tokens', '?')} response tokens ranked)"


class DraftVocab(nn.Module):
    """The target LM head's rows of `ids` as a Linear of their own (the engine's matmul paths: the CPU packed
    float32 matmul, the CUDA GEMV), and the maps from its outputs back to the target's vocabulary. A round's
    vocabulary adds its requests' own tokens outside the ranked ids (`round`): the names and numbers of a prompt,
    which a drafter copies and no frequency list holds."""

    def __init__(self, lm_head: nn.Module, ids: list[int], vocab_size: int, source: str):
        super().__init__()
        if len(set(ids)) != len(ids) or min(ids) < 0 or max(ids) >= vocab_size:
            raise ConfigError(f"the draft vocabulary ({source}) must list distinct token ids below the target's "
                              f"vocabulary size {vocab_size}")
        weight = getattr(lm_head, "weight", None)
        if isinstance(weight, torch.Tensor) and weight.is_meta and isinstance(lm_head, nn.Linear):
            weight = dense_weight(lm_head)  # a CPU float32 head kept in oneDNN's blocked layout only
        first = getattr(lm_head, "dense_rows", lambda ids: None)(torch.zeros(1, dtype=torch.int64))
        if isinstance(weight, torch.Tensor) and not weight.is_meta:
            self._rows = weight.__getitem__
        elif first is not None:
            self._rows, weight = lm_head.dense_rows, first  # a CPU head packed for the int8 kernel: rows as needed
        else:
            raise ConfigError("draft_vocab_size needs the target's LM head as a dense matrix or one the CPU's int8 "
                              "kernel runs; this target keeps it packed otherwise: leave draft_vocab_size unset")
        self.vocab_size, self.source = vocab_size, source
        self.register_buffer("ids", torch.tensor(ids, dtype=torch.int64, device=weight.device), persistent=False)
        self.head = Linear(weight.shape[1], len(ids), bias=False, device=weight.device, dtype=weight.dtype)
        with torch.no_grad():
            self.head.weight.copy_(self._rows(self.ids))
        self.head.requires_grad_(False)
        self.head.use_fused = getattr(lm_head, "use_fused", False)
        pack_weights(self)  # float32 on CPU: the batch-invariant packed matmul, as the target's head
        self.ranked = frozenset(ids)  # on the host: a round's own tokens are picked there, with no device sync
        self.round_ids, self.own_rows = self.ids, None  # this round's ids and the head rows of its own tokens
        self.own_tokens = 0  # own tokens scored over every round (for describe)
        self.seen: dict[str, tuple[int, set[int]]] = {}  # request -> (tokens read, its own tokens so far)
        self.round_own: set[int] = set()  # the own tokens this round's rows hold

    @classmethod
    def first(cls, lm_head: nn.Module, ranked: tuple[list[int], str], size: int, vocab_size: int) -> "DraftVocab":
        """The draft vocabulary of the `size` first of the ranked ids (`ranked`: ids, where they came from)."""
        ids, source = ranked
        if size > len(ids):
            raise ConfigError(f"draft_vocab_size {size} is above the {len(ids)} token ids the draft vocabulary "
                              f"ranks ({source}): ask for at most {len(ids)}")
        return cls(lm_head, ids[:size], vocab_size, source)

    def round(self, seqs) -> None:
        """Set this round's vocabulary: the ranked ids, then the tokens of the round's requests (prompt and
        output so far) that are not among them. Each request's own tokens are gathered once, as they arrive
        (host work per round grows with the new tokens, not with the context), and the round's rows are rebuilt
        only when their union changes."""
        own: set[int] = set()
        for seq in seqs:
            seen, mine = self.seen.get(seq.request_id, (0, set()))
            tokens = seq.token_ids
            if len(tokens) > seen:
                mine.update(t for t in tokens[seen:] if t not in self.ranked)
                self.seen[seq.request_id] = (len(tokens), mine)
            own |= mine
        if own != self.round_own:
            self.round_own = own
            if own:
                rows = to_device(sorted(own), self.ids.device, torch.int64)
                self.round_ids, self.own_rows = torch.cat([self.ids, rows]), self._rows(rows)
            else:
                self.round_ids, self.own_rows = self.ids, None
        self.own_tokens += len(own)

    def forget(self, request_id: str) -> None:
        """Drop a finished request's own tokens."""
        self.seen.pop(request_id, None)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over this round's vocabulary [rows, N + its own tokens]."""
        logits = self.head(hidden)
        return logits if self.own_rows is None else torch.cat([logits, F.linear(hidden, self.own_rows)], dim=-1)

    def token_ids(self, picked: torch.Tensor) -> torch.Tensor:
        """Positions in this round's vocabulary -> the target's token ids."""
        return self.round_ids[picked]

    def widen(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits over this round's vocabulary as logits over the target's [rows, V] (-inf elsewhere, never
        drawn): a sampled draft is then drawn by token id, with the target's keys (keyed_draws.py)."""
        out = logits.new_full((logits.shape[0], self.vocab_size), float("-inf"))
        return out.scatter_(1, self.round_ids.expand(logits.shape[0], -1), logits)

    def describe(self) -> dict:
        return {"size": int(self.ids.numel()), "of": self.vocab_size, "source": self.source,
                "plus": "each round's requests' own tokens", "own_tokens_scored": self.own_tokens}
