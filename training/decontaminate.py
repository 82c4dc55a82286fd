"""Keeps evaluation items out of a drafter's training prompts.

A drafter trained on the prompts it is later measured on would report acceptance it does not have on
new text. Two checks, both on `normalize_text`: the whole prompt equals an evaluation item (same
`text_hash`), or the prompt shares a run of NGRAM words with one (the contamination test of the GPT-3
paper, 13 words), which also catches an evaluation item pasted inside a longer prompt.
The evaluation texts come from the caller (the CLI resolves the harness's datasets).
"""
from __future__ import annotations

import re
from collections.abc import Iterable

from onecat.training.prompts import normalize_text, text_hash

NGRAM = 13
_WORD = re.compile(r"\w+")


def word_ngrams(text: str, n: int = NGRAM) -> set[str]:
    words = _WORD.findall(normalize_text(text))
    return {" ".join(words[i:i + n]) for i in range(len(words) - n + 1)}


class EvaluationOverlap:
    """`check(text)` names the evaluation set a training text overlaps, or returns None."""

    def __init__(self, sets: dict[str, Iterable[str]], ngram: int = NGRAM):
        self.ngram = ngram
        self.hashes: dict[str, str] = {}
        self.ngrams: dict[str, str] = {}
        self.sizes: dict[str, int] = {}
        for name, texts in sets.items():
            count = 0
            for text in texts:
                if not text.strip():
                    continue
                count += 1
                self.hashes.setdefault(text_hash(text), name)
                for g in word_ngrams(text, ngram):
                    self.ngrams.setdefault(g, name)
            self.sizes[name] = count

    def check(self, text: str) -> str | None:
        hit = self.hashes.get(text_hash(text))
        if hit is not None:
            return hit
        for g in word_ngrams(text, self.ngram):
            hit = self.ngrams.get(g)
            if hit is not None:
                return hit
        return None

    def describe(self) -> dict:
        return {"sets": dict(self.sizes), "rule": f"equal text_hash or a shared {self.ngram}-word run"}
