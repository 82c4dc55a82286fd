"""Loads an HF model directory: config.json, *.safetensors, tokenizer.json (+ tokenizer_config.json).

A checkpoint with a `quantization_config` (AWQ, GPTQ, compressed-tensors, ModelOpt, MXFP4) is read
through engine/quant/checkpoint_formats: its quantized linears come out as dense `.weight` tensors in HF names."""
from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from onecat.engine.errors import CorruptModelError
from onecat.engine.quant.checkpoint_formats import QuantFormat, dense_weights


def read_hf_config(path: Path) -> dict:
    try:
        return json.loads((path / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise CorruptModelError(f"{path / 'config.json'} is not valid JSON ({e})") from None


def _unreadable(f: Path, e: Exception) -> CorruptModelError:
    return CorruptModelError(f"cannot read weights from {f}: {e}. The file is truncated or corrupt; "
                             "download it again")


def iter_hf_weights(path: Path, quant: QuantFormat | None = None,
                    on_quantized=None) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the directory's safetensors files, in file order; with `quant`, the quantized
    linears dequantized (their parts may sit in different shards, so all files stay open meanwhile), each
    one's stored parts shown to `on_quantized` first (see checkpoint_formats.dense_weights)."""
    files = sorted(path.glob("*.safetensors"))
    if quant is None:
        for f in files:
            try:
                with safe_open(str(f), framework="pt") as fh:
                    for name in fh.keys():
                        yield name, fh.get_tensor(name)
            except (SafetensorError, OSError, RuntimeError) as e:
                raise _unreadable(f, e) from None
        return
    with ExitStack() as stack:
        where: dict[str, tuple[Path, object]] = {}
        names: list[str] = []
        for f in files:
            try:
                fh = stack.enter_context(safe_open(str(f), framework="pt"))
                keys = list(fh.keys())
            except (SafetensorError, OSError, RuntimeError) as e:
                raise _unreadable(f, e) from None
            names += keys
            where.update((k, (f, fh)) for k in keys)

        def get(name: str) -> torch.Tensor:
            f, fh = where[name]
            try:
                return fh.get_tensor(name)
            except (SafetensorError, OSError, RuntimeError) as e:
                raise _unreadable(f, e) from None

        yield from dense_weights(names, get, quant, on_quantized)
