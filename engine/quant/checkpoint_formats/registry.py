"""Names a checkpoint's quantization format from its config and turns its stored linears into dense weights.

A format is a `QuantFormat` subclass registered under the `quant_method` its config carries (the
package's __init__ imports every format module, so the registry is full once the package is imported). The loader
streams the checkpoint's tensors through `dense_weights`: every linear the format stored quantized reaches
the model as one dense `<module>.weight` in HF names (float32, computed exactly where the format allows),
one linear at a time, so at most one linear is held dequantized beyond the model itself.
"""
from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from onecat.engine.errors import CorruptModelError, UnsupportedModelError

FORMATS: dict[str, type[QuantFormat]] = {}


def register(*methods: str):
    """Class decorator: the format reads configs whose `quant_method` is one of `methods`."""
    def wrap(cls: type[QuantFormat]) -> type[QuantFormat]:
        for m in methods:
            FORMATS[m] = cls
        return cls
    return wrap


class QuantFormat:
    """One checkpoint format. Subclasses set `parts` (the tensor suffixes a quantized linear stores, the
    marker first) and implement `dequantize`; the constructor refuses variants the format cannot read."""

    method = ""
    parts: tuple[str, ...] = ()
    dropped: tuple[str, ...] = ()  # activation / KV-cache scales: not applied, consumed wherever they appear

    def __init__(self, config: dict) -> None:
        self.config = config

    def describe(self) -> str:
        return self.method

    def is_quantized(self, present: dict[str, str]) -> bool:
        """Whether a module whose stored parts are `present` (part -> tensor name) is a quantized linear."""
        return self.parts[0] in present

    def dequantize(self, module: str, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        """The dense [out_features, in_features] float32 weight of `module` from its stored tensors."""
        raise NotImplementedError

    def require(self, module: str, tensors: dict[str, torch.Tensor], *names: str) -> list[torch.Tensor]:
        missing = [n for n in names if n not in tensors]
        if missing:
            raise CorruptModelError(f"{self.describe()} checkpoint: {module} has no {', '.join(missing)} "
                                    f"(it stores {', '.join(sorted(tensors))}); the weights are incomplete")
        return [tensors[n] for n in names]

    def bad(self, module: str, what: str) -> CorruptModelError:
        return CorruptModelError(f"{self.describe()} checkpoint: {module}: {what}; the weights do not match "
                                 "their quantization_config (re-export or re-download the checkpoint)")


def quantization_config(raw: dict, path: Path) -> dict | None:
    """config.json's `quantization_config`, else ModelOpt's hf_quant_config.json next to it (as an
    equivalent {quant_method: modelopt, ...} dict); None for a dense checkpoint."""
    qc = raw.get("quantization_config")
    if qc:
        return qc
    side = path / "hf_quant_config.json"
    if not side.is_file():
        return None
    try:
        data = json.loads(side.read_text())
    except json.JSONDecodeError as e:
        raise CorruptModelError(f"{side} is not valid JSON ({e})") from None
    return {"quant_method": "modelopt", **(data.get("quantization") or {})}


def quant_format(raw: dict, path: Path) -> QuantFormat | None:
    """The format that reads this HF checkpoint's quantized linears, or None when it has none."""
    qc = quantization_config(raw, path)
    if qc is None:
        return None
    method = str(qc.get("quant_method", "")).lower()
    cls = FORMATS.get(method)
    if cls is None:
        raise UnsupportedModelError(
            f"quantization_config quant_method={qc.get('quant_method')!r} is not supported; onecat reads "
            f"{', '.join(sorted(FORMATS))} checkpoints (dequantized to the model dtype), or use a dense "
            "or GGUF export of the model")
    return cls(qc)


def dense_weights(names: list[str], get: Callable[[str], torch.Tensor], fmt: QuantFormat,
                  on_quantized: Callable[[QuantFormat, str, dict[str, torch.Tensor]], None] | None = None,
                  ) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors in stored order, each quantized linear replaced by its dense `.weight`
    (at its first stored part); dropped scales are left out, everything else passes unchanged.
    `on_quantized(fmt, module, stored parts)` sees each quantized linear's stored tensors first (a packer
    that keeps them packed)."""
    by_module: dict[str, dict[str, str]] = {}
    for n in names:
        module, _, part = n.rpartition(".")
        if part in fmt.parts:
            by_module.setdefault(module, {})[part] = n
    quantized = {m: parts for m, parts in by_module.items() if fmt.is_quantized(parts)}
    done: set[str] = set()
    for n in names:
        module, _, part = n.rpartition(".")
        if part in fmt.dropped:
            continue
        if module in quantized and part in fmt.parts:
            if module not in done:
                done.add(module)
                stored = {p: get(name) for p, name in quantized[module].items()}
                if on_quantized is not None:
                    on_quantized(fmt, module, stored)
                yield f"{module}.weight", fmt.dequantize(module, stored)
            continue
        yield n, get(n)
