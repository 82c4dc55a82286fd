"""Weights kept in a compact format at run time, with the matmul kernels that read them directly.

`quantization=None` dequantizes everything into the model dtype (the exact reference path);
`quantization="gguf"` keeps a GGUF checkpoint's block tensors (Q4_0, Q4_1, Q8_0) packed as 4-bit
terms and runs them through a 4-bit group-32 matmul, so a CPU decode step streams several times
fewer weight bytes than with fp32 weights.
"""
from onecat.engine.quant.int4_blocks import Int4Blocks, QuantizedWeight
from onecat.engine.quant.packing import QUANTIZATIONS, WeightPacker, check_quantization

__all__ = ["Int4Blocks", "QUANTIZATIONS", "QuantizedWeight", "WeightPacker", "check_quantization"]
