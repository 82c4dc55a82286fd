"""The CPU int4 layout: 4-bit codes in groups of 32 with a bfloat16 scale and zero each, the form of torch's
CPU int4 matmul. layout.py decodes GGUF Q4_0 / Q4_1 / Q8_0 blocks into it (Q8_0 as two 4-bit terms);
linear.py is the layer that runs on it. W4A16 checkpoints reach it on CPU through w4a16/cpu.py."""
