"""A drafter's draft vocabulary: the target's own response tokens ranked by how often it writes them.

A DFlash drafter scores its drafts with the target's LM head, and on a small target that head is a large
share of a round (SmolLM2-135M: 49,152 x 576, about as many bytes as the target's packed layers): drafting
over the few thousand tokens the target actually writes reads a fraction of it (EAGLE-3's draft vocabulary).
The verifier still scores the target's whole vocabulary, so a token outside the draft vocabulary costs at
most an early rejection, never a wrong token. The ranking comes from the target's answers to ShareGPT
prompts (the drafter's training source, never an evaluation set), written to the drafter's folder as
`draft_vocab.json`, which `speculative_config.draft_vocab_size` reads (engine/speculative/draft_vocab.py).
`onecat drafter vocab` runs it with the evaluation sets excluded from the prompts, as training does.
"""
from __future__ import annotations

import collections
import json
from collections.abc import Callable
from pathlib import Path

from onecat.training.prompts import SHAREGPT_DISTRIBUTION, load_prompts, parse_data_spec
from onecat.training.provenance import data_provenance, target_provenance
from onecat.training.regenerate import regenerate


def rank_tokens(responses: list[list[int]]) -> tuple[list[int], list[int]]:
    """(ids, counts): every token id the responses hold, most frequent first (ties: lower id first)."""
    counts = collections.Counter(t for ids in responses for t in ids)
    ranked = sorted(counts.items(), key=lambda item: (-item[1], item[0]))
    return [i for i, _ in ranked], [c for _, c in ranked]


def build_draft_vocab(target: str, data: str, out: str | Path, *, max_new_tokens: int = 128, batch: int = 16,
                      seed: int = 0, exclude: Callable[[str], str | None] | None = None,
                      exclude_description: dict | None = None) -> dict:
    """Answer the prompts of `data` (sharegpt:N, greedy) with `target` on the CPU and write the ranking to `out`.
    `exclude(text)` names the evaluation set a prompt overlaps (such prompts are not chosen)."""
    from onecat.engine import LLM

    llm = LLM(target, dtype="auto", max_model_len=1024, max_num_seqs=batch, seed=seed)
    spec = parse_data_spec(data)
    if spec.kind != "sharegpt":
        raise ValueError(f"{data}: the draft vocabulary is ranked on ShareGPT prompts (sharegpt:N), never on a "
                         "prompt file that could hold evaluation questions")
    prompts, summary = load_prompts(spec, lambda text: len(llm.tokenizer.encode(text)), seed=seed, exclude=exclude)
    if exclude_description is not None:
        summary["evaluation_exclusion"] = exclude_description
    samples, stats = regenerate(llm, [p.text for p in prompts], max_new_tokens=max_new_tokens, sampled_fraction=0.0,
                                temperature=1.0, top_p=1.0, seed=seed)
    ids, counts = rank_tokens([s.response_ids for s in samples])
    record = {"format": 1, "what": "token ids of the target's greedy answers, most frequent first (a DFlash "
                                   "drafter's draft vocabulary: speculative_config.draft_vocab_size takes the first N)",
              "target": target_provenance(llm.source.source, llm.source.path, llm.source.sha256()),
              "data": {**data_provenance(spec.kind, None, spec.count, None, SHAREGPT_DISTRIBUTION),
                       "selection": summary},
              "max_new_tokens": max_new_tokens, "responses": len(samples), "tokens": sum(counts),
              "vocab_size": llm.model_config.vocab_size, "ids": ids, "counts": counts,
              "regeneration": {k: stats[k] for k in ("response_tokens", "seconds", "response_tokens_per_s")}}
    llm.close()
    Path(out).write_text(json.dumps(record) + "\n")
    return record
