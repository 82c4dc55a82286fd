"""Weights kept in a compact format at run time, with the matmul kernels that read them directly.

`quantization=None` dequantizes everything into the model dtype (the exact reference path); a
`quantization` name keeps the checkpoint's quantized linears packed and runs them through kernels that
read the packed words, so a decode step streams several times fewer weight bytes.

Two axes, one folder kind each:
  checkpoint_formats/   how a quantized HF checkpoint stores its linears (AWQ, GPTQ, compressed-tensors,
                        ModelOpt, MXFP4), read exactly into dense weights: the reference every packed path
                        is checked against;
  int4/ w4a16/ fp4/ fp8/  the packed layouts the kernels read at run time, one folder each: layout.py (the
                        words and their exact dequantization), packing.py (a checkpoint's tensors re-packed
                        without changing a value), linear.py (the layer that runs on them).
The packers swap a loaded model's linears for packed ones: gguf_packer.py (GGUF Q4_0 / Q4_1 / Q8_0 blocks
into the CPU int4 layer) and hf_packer.py (HF checkpoints into the W4A16, FP4 and FP8 layers, MoE experts and
hybrid layers included, through packed_model.py; row_split.py for fused projections stored partly dense);
quantization.py names what `quantization` takes. bits.py (bit fields, FP4 codes) serves both axes, tiled_words.py the GPU layers.
"""
from onecat.engine.quant.gguf_packer import WeightPacker
from onecat.engine.quant.int4.layout import Int4Blocks, QuantizedWeight
from onecat.engine.quant.quantization import QUANTIZATIONS, check_quantization

__all__ = ["Int4Blocks", "QUANTIZATIONS", "QuantizedWeight", "WeightPacker", "check_quantization"]
