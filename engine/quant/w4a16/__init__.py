"""The W4A16 layout: 4-bit codes with a scale and a zero per group of 32-128 input columns, read by the CUDA
and Triton 4-bit GEMVs. layout.py holds the words, their exact dequantization and a round-to-nearest
quantizer; packing.py re-packs AWQ, GPTQ and compressed-tensors checkpoints into it; linear.py is the GPU
layer; cpu.py hands the same codes to the CPU int4 layer (int4/)."""
