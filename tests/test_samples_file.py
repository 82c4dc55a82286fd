"""Regenerated samples on disk (training/samples_file.py): both forms give back what was saved; the folder of
compact parts keeps every part under its size limit and names a missing or altered part."""
from __future__ import annotations

import json
import random

import pytest

from onecat.engine.errors import ConfigError
from onecat.training.regenerate import Sample
from onecat.training.samples_file import load_samples, save_samples

HEADER = {"target_sha256": "ab" * 32, "prompts": 40, "max_new_tokens": 64}


def _samples(n: int, vocab: int, seed: int = 0) -> list[Sample]:
    r = random.Random(seed)
    return [Sample([r.randrange(vocab) for _ in range(r.randrange(4, 90))],
                   [r.randrange(vocab) for _ in range(r.randrange(2, 120))], r.random() < 0.3, r.random() < 0.8,
                   i, r.randrange(3))  # keys kept: a later run continues by them
            for i in range(n)]


@pytest.mark.parametrize("name", ["samples.jsonl", "samples"])
def test_both_forms_give_back_the_samples(tmp_path, name):
    samples = _samples(200, 49152)
    save_samples(tmp_path / name, samples, HEADER, max_part_bytes=20_000)
    assert load_samples(tmp_path / name, HEADER) == samples
    assert not list(tmp_path.glob(".*partial"))  # written through a temporary name, then moved in place


def test_parts_stay_under_their_limit_and_store_two_bytes_a_token(tmp_path):
    samples = _samples(300, 49152)
    save_samples(tmp_path / "s", samples, HEADER, max_part_bytes=20_000)
    head = json.loads((tmp_path / "s" / "header.json").read_text())
    assert head["token_dtype"] == "uint16" and len(head["parts"]) > 3
    assert sum(p["samples"] for p in head["parts"]) == len(samples)
    assert all((tmp_path / "s" / p["file"]).stat().st_size <= 20_000 for p in head["parts"])
    wide = _samples(20, 70_000, seed=1)  # a vocabulary past 16 bits keeps 32-bit ids
    save_samples(tmp_path / "w", wide, HEADER)
    assert json.loads((tmp_path / "w" / "header.json").read_text())["token_dtype"] == "uint32"
    assert load_samples(tmp_path / "w", HEADER) == wide


def test_a_missing_or_altered_part_or_another_run_is_refused_by_name(tmp_path):
    folder = tmp_path / "s"
    save_samples(folder, _samples(300, 49152), HEADER, max_part_bytes=20_000)
    with pytest.raises(ConfigError, match="made for another run .*max_new_tokens: file has 64, this run 128"):
        load_samples(folder, {**HEADER, "max_new_tokens": 128})
    part = folder / "part-001.npz"
    data = part.read_bytes()
    part.write_bytes(data[:-100])
    with pytest.raises(ConfigError, match="part part-001.npz is not the part that was written"):
        load_samples(folder, HEADER)
    part.unlink()
    with pytest.raises(ConfigError, match="part part-001.npz is missing"):
        load_samples(folder, HEADER)
    (tmp_path / "other").mkdir()
    with pytest.raises(ConfigError, match="not a file of regenerated samples"):
        load_samples(tmp_path / "other", HEADER)


def test_a_setting_newer_than_the_file_reads_as_its_old_default(tmp_path):
    save_samples(tmp_path / "old.jsonl", _samples(5, 100), HEADER)  # written before extra_sampled_answers existed
    assert len(load_samples(tmp_path / "old.jsonl", {**HEADER, "extra_sampled_answers": 0})) == 5
    with pytest.raises(ConfigError, match="extra_sampled_answers: file has 0, this run 2"):
        load_samples(tmp_path / "old.jsonl", {**HEADER, "extra_sampled_answers": 2})
