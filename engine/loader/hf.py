"""Loads an HF model directory: config.json, *.safetensors, tokenizer.json (+ tokenizer_config.json)."""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from onecat.engine.errors import CorruptModelError


def read_hf_config(path: Path) -> dict:
    try:
        return json.loads((path / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise CorruptModelError(f"{path / 'config.json'} is not valid JSON ({e})") from None


def iter_hf_weights(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    files = sorted(path.glob("*.safetensors"))
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as fh:
                for name in fh.keys():
                    yield name, fh.get_tensor(name)
        except (SafetensorError, OSError, RuntimeError) as e:
            raise CorruptModelError(
                f"cannot read weights from {f}: {e}. The file is truncated or corrupt; "
                "download it again") from None
