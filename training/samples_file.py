"""Regenerated responses kept on disk, so a later run (longer training, another recipe) skips the
slowest phase. JSON lines: a header naming the target (sha256 of its weights), the prompt source and
the regeneration settings, then one sample per line. A file made for another target or other
settings is refused, never silently mixed in: the drafter must learn this target's own answers."""
from __future__ import annotations

import json
import os
from pathlib import Path

from onecat.engine.errors import ConfigError
from onecat.training.regenerate import Sample

FORMAT = "onecat-drafter-samples/1"


def save_samples(path: Path, samples: list[Sample], header: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.partial")
    with tmp.open("w") as f:
        f.write(json.dumps({"format": FORMAT, **header}) + "\n")
        for s in samples:
            f.write(json.dumps({"p": s.prompt_ids, "r": s.response_ids, "s": s.sampled, "f": s.finished}) + "\n")
    os.replace(tmp, path)


def load_samples(path: Path, header: dict) -> list[Sample]:
    """The samples of `path`; a ConfigError when its header disagrees with `header` on any key."""
    with path.open() as f:
        try:
            head = json.loads(f.readline())
        except json.JSONDecodeError:
            head = {}
        if head.get("format") != FORMAT:
            raise ConfigError(f"samples_file {path} is not a file of regenerated samples ({FORMAT}); "
                              "delete it or give another path")
        wrong = {k: (head.get(k), v) for k, v in header.items() if head.get(k) != v}
        if wrong:
            detail = "; ".join(f"{k}: file has {a!r}, this run {b!r}" for k, (a, b) in wrong.items())
            raise ConfigError(f"samples_file {path} was made for another run ({detail}); delete it to regenerate, "
                              "or give another path")
        samples = [Sample(row["p"], row["r"], row["s"], row["f"]) for row in map(json.loads, f)]
    if not samples:
        raise ConfigError(f"samples_file {path} holds no sample; delete it to regenerate")
    return samples
