"""Checkpoint loading: one entry point for HF directories and GGUF files."""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from onecat.engine.config import ModelConfig
from onecat.engine.model_source import ResolvedModel
from onecat.engine.tokenizer import Tokenizer


@dataclass
class Checkpoint:
    config: ModelConfig
    tokenizer: Tokenizer
    weights: Iterator[tuple[str, torch.Tensor]]  # HF names and layout, lazily produced
    stored_as: str | None = None  # a quantized HF checkpoint's format (e.g. "awq w4 g128"), read dequantized


def open_checkpoint(model: ResolvedModel, keep_quantized: bool = False, on_quantized=None) -> Checkpoint:
    """keep_quantized: GGUF block-quantized tensors come as `QuantizedWeight` (for quantization='gguf').
    A quantized HF checkpoint (config.json `quantization_config`) always yields dense weights;
    `on_quantized(fmt, module, stored parts)` sees each quantized linear's stored tensors first (the
    W4A16 packer keeps them)."""
    if model.format == "gguf":
        from onecat.engine.loader.gguf import gguf_to_hf_config, iter_gguf_weights, open_gguf
        from onecat.engine.loader.gguf_tokenizer import tokenizer_from_gguf

        reader = open_gguf(model.path)
        raw = gguf_to_hf_config(reader, model.path)
        weights = iter_gguf_weights(reader, raw, keep_quantized)
        return Checkpoint(ModelConfig.from_hf(raw), tokenizer_from_gguf(reader), weights)
    from onecat.engine.loader.hf import iter_hf_weights, read_hf_config
    from onecat.engine.quant.checkpoint_formats import quant_format

    raw = read_hf_config(model.path)
    cfg = ModelConfig.from_hf(raw)
    quant = quant_format(raw, model.path)
    return Checkpoint(cfg, Tokenizer.from_hf_dir(model.path, cfg.eos_token_id), iter_hf_weights(model.path, quant, on_quantized),
                      quant.describe() if quant else None)
