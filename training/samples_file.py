"""Regenerated responses kept on disk, so a later run (longer training, another recipe) skips the
slowest phase. Every form names the target (sha256 of its weights), the prompt source and the
regeneration settings; samples made for another target or other settings are refused, never silently
mixed in: the drafter must learn this target's own answers.

Two forms, chosen by the path:
- `NAME.jsonl`: JSON lines, a header then one sample per line (readable, ~6 bytes a token).
- any other path: a folder of compact parts, for data regenerated on one machine and trained on another
  through size-limited transfers: `header.json` (the header, the token dtype, and each part's file, sample
  count and sha256) and `part-NNN.npz` files, each a compressed numpy archive of the parts' token ids (uint16
  where the vocabulary allows), prompt and response lengths, flags and keys, none larger than `max_part_bytes`
  (a part is cut by its raw size, which compression only shrinks). A missing or altered part is named.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import numpy as np

from onecat.engine.errors import ConfigError
from onecat.training.regenerate import Sample

FORMAT = "onecat-drafter-samples/1"
PARTS_FORMAT = "onecat-drafter-samples-parts/1"
MAX_PART_BYTES = 15 * 2**20  # under a 16 MiB per-file transfer limit
SAMPLED, FINISHED = 1, 2  # flag bits
UNRECORDED = {"extra_sampled_answers": 0}  # settings that files written before they existed were made with


def save_samples(path: Path, samples: list[Sample], header: dict, max_part_bytes: int = MAX_PART_BYTES) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.partial")
    if path.suffix == ".jsonl":
        with tmp.open("w") as f:
            f.write(json.dumps({"format": FORMAT, **header}) + "\n")
            for s in samples:
                f.write(json.dumps({"p": s.prompt_ids, "r": s.response_ids, "s": s.sampled, "f": s.finished,
                                    "i": s.prompt_index, "a": s.answer}) + "\n")
    else:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        _write_parts(tmp, samples, header, max_part_bytes)
        if path.is_dir():  # a folder cannot be replaced in one step: the old one steps aside, then goes
            old = path.with_name(f".{path.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old)
            return
    os.replace(tmp, path)


def load_samples(path: Path, header: dict) -> list[Sample]:
    """The samples of `path`; a ConfigError when its header disagrees with `header` on any key."""
    if path.is_dir():
        samples = _read_parts(path, header)
    else:
        with path.open() as f:
            try:
                head = json.loads(f.readline())
            except json.JSONDecodeError:
                head = {}
            _check_header(path, head, FORMAT, header)
            samples = [Sample(row["p"], row["r"], row["s"], row["f"], row.get("i", -1), row.get("a", 0))
                       for row in map(json.loads, f)]
    if not samples:
        raise ConfigError(f"samples_file {path} holds no sample; delete it to regenerate")
    return samples


def stored_header(path: Path) -> dict:
    """The header `path` was saved with (its settings, and `complete`: whether every answer asked exists)."""
    if path.is_dir():
        return json.loads((path / "header.json").read_text())
    with path.open() as f:
        return json.loads(f.readline())


def _check_header(path: Path, head: dict, form: str, header: dict) -> None:
    if head.get("format") != form:
        raise ConfigError(f"samples_file {path} is not a file of regenerated samples ({form}); "
                          "delete it or give another path")
    stored = {**UNRECORDED, **head}
    wrong = {k: (stored.get(k), v) for k, v in header.items() if stored.get(k) != v}
    if wrong:
        detail = "; ".join(f"{k}: file has {a!r}, this run {b!r}" for k, (a, b) in wrong.items())
        raise ConfigError(f"samples_file {path} was made for another run ({detail}); delete it to regenerate, "
                          "or give another path")


def _chunks(samples: list[Sample], itemsize: int, budget: int):
    """Consecutive runs of samples whose raw bytes (ids; two int32 lengths, a flag byte, an int32 prompt index and
    answer each) fit `budget` (a larger sample is a run of its own)."""
    run, size = [], 0
    for s in samples:
        n = (len(s.prompt_ids) + len(s.response_ids)) * itemsize + 17
        if run and size + n > budget:
            yield run
            run, size = [], 0
        run.append(s)
        size += n
    if run:
        yield run


def _write_parts(folder: Path, samples: list[Sample], header: dict, max_part_bytes: int) -> None:
    top = max((max(s.prompt_ids + s.response_ids, default=0) for s in samples), default=0)
    dtype = np.dtype(np.uint16 if top < 2**16 else np.uint32)
    parts = []
    for i, run in enumerate(_chunks(samples, dtype.itemsize, max_part_bytes - 4096)):  # 4 KiB: the archive's own
        name = f"part-{i:03d}.npz"
        ids = np.fromiter((t for s in run for t in s.prompt_ids + s.response_ids), dtype=dtype)
        np.savez_compressed(folder / name, ids=ids,
                            prompt_lens=np.array([len(s.prompt_ids) for s in run], dtype=np.int32),
                            response_lens=np.array([len(s.response_ids) for s in run], dtype=np.int32),
                            flags=np.array([SAMPLED * s.sampled | FINISHED * s.finished for s in run], dtype=np.uint8),
                            prompt_index=np.array([s.prompt_index for s in run], dtype=np.int32),
                            answer=np.array([s.answer for s in run], dtype=np.int32))
        parts.append({"file": name, "samples": len(run), "sha256": _sha256(folder / name)})
    (folder / "header.json").write_text(json.dumps({"format": PARTS_FORMAT, **header, "token_dtype": dtype.name,
                                                    "parts": parts}, indent=1) + "\n")


def _read_parts(folder: Path, header: dict) -> list[Sample]:
    try:
        head = json.loads((folder / "header.json").read_text())
    except (OSError, json.JSONDecodeError):
        head = {}
    _check_header(folder, head, PARTS_FORMAT, header)
    samples = []
    for part in head["parts"]:
        f = folder / part["file"]
        if not f.is_file():
            raise ConfigError(f"samples_file {folder}: part {part['file']} is missing; copy every part that "
                              "header.json lists into the folder, or delete the folder to regenerate")
        if _sha256(f) != part["sha256"]:
            raise ConfigError(f"samples_file {folder}: part {part['file']} is not the part that was written (its "
                              "sha256 differs: cut short or altered in transfer); copy it again, or delete the "
                              "folder to regenerate")
        with np.load(f) as z:
            ids, plens, rlens, flags, index, answer = (z[k].tolist() for k in ("ids", "prompt_lens", "response_lens",
                                                                              "flags", "prompt_index", "answer"))
        at = 0
        for p, r, fl, i, a in zip(plens, rlens, flags, index, answer):
            samples.append(Sample(ids[at:at + p], ids[at + p:at + p + r], bool(fl & SAMPLED), bool(fl & FINISHED),
                                  i, a))
            at += p + r
        if len(plens) != part["samples"] or at != len(ids):
            raise ConfigError(f"samples_file {folder}: part {part['file']} holds {len(plens)} samples where "
                              f"header.json says {part['samples']}; delete the folder to regenerate")
    return samples


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
