"""How a drafter names its inputs: by package, version and sha256, never by a path on one machine.

A published drafter's config.json (its `training` block) says which target and which data made it. A
path such as /tmp/m/model.gguf means nothing elsewhere; the installed package that ships the file, its
version and the file's sha256 let anyone fetch and check the same bytes.
"""
from __future__ import annotations

import importlib.metadata
import json
from pathlib import Path

from onecat.engine.model_source import EMBEDDED_MODELS, EMBEDDED_PREFIX, ResolvedModel


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _shipping_package(name: str, sha256: str) -> tuple[str, str] | None:
    """(embedded model name, distribution) whose installed file has this name and these bytes, if any."""
    for model, (dist, filename) in EMBEDDED_MODELS.items():
        if filename != name or _version(dist) is None:
            continue
        for f in importlib.metadata.files(dist) or []:
            path = Path(f.locate())
            if str(f).endswith(filename) and path.is_file() and ResolvedModel(filename, path, "gguf").sha256() == sha256:
                return model, dist
    return None


def target_provenance(source: str, path: Path, sha256: str) -> dict:
    """The target as package + version + file + sha256 where an installed package ships those bytes
    (also when it was opened through a copy elsewhere), else as file name + sha256."""
    name = path.name
    shipped = _shipping_package(name, sha256)
    if shipped is not None:
        model, dist = shipped
        return {"source": EMBEDDED_PREFIX + model, "package": dist, "version": _version(dist), "file": name,
                "sha256": sha256}
    if source.startswith(EMBEDDED_PREFIX) or not Path(source).exists():
        return {"source": source, "file": name, "sha256": sha256}  # an embedded or hub name travels as is
    return {"file": name, "sha256": sha256}


def data_provenance(kind: str, path: Path | None, count: int | None, sha256: str | None,
                    package: str) -> dict:
    """The training prompts as `sharegpt:N` from `package` and its version, or a prompt file by name and
    sha256, with the package it was drawn from when its `.meta.json` (written by `onecat drafter prompts`)
    says so."""
    if kind == "sharegpt":
        return {"spec": f"sharegpt:{count}", "package": package, "version": _version(package)}
    out = {"spec": f"jsonl:{path.name}", "sha256": sha256}
    meta = Path(f"{path}.meta.json")
    if meta.is_file():
        try:
            drawn = json.loads(meta.read_text()).get("package")
        except (json.JSONDecodeError, AttributeError):
            drawn = None
        if isinstance(drawn, dict) and drawn.get("name"):
            out["derived_from"] = {"package": drawn["name"], "version": drawn.get("version")}
    return out


def _portable(value: str) -> str:
    """An absolute path (alone or after a `kind:` prefix) reduced to its file name."""
    kind, sep, rest = value.partition(":")
    if sep and "/" not in kind and rest.startswith("/"):
        return f"{kind}:{Path(rest).name}"
    return Path(value).name if value.startswith("/") else value


def without_paths(record):
    """The training record with every absolute path reduced to its file name: the record travels with the
    drafter, and its inputs are named by package, version and sha256 beside those names."""
    if isinstance(record, dict):
        return {k: without_paths(v) for k, v in record.items()}
    if isinstance(record, list):
        return [without_paths(v) for v in record]
    return _portable(record) if isinstance(record, str) else record
