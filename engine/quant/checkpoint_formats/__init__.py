"""Quantized HF checkpoints read exactly: each stored quantized linear becomes its dense weight.

This is the reference path for AWQ, GPTQ, compressed-tensors, ModelOpt (NVFP4, FP8) and MXFP4
checkpoints: the model then runs dense in the model dtype (no `quantization` setting), which every later
packed kernel is checked against. `quant_format` names a checkpoint's format from its config;
`dense_weights` streams its tensors with the quantized linears dequantized one at a time.
"""
from onecat.engine.quant.checkpoint_formats import (  # noqa: F401  (each registers its format)
    awq, compressed_tensors, gptq, modelopt, mxfp4)
from onecat.engine.quant.checkpoint_formats.registry import FORMATS, QuantFormat, dense_weights, quant_format

__all__ = ["FORMATS", "QuantFormat", "dense_weights", "quant_format"]
