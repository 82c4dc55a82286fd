"""The packed FP8 (E4M3, W8A16) layout: the checkpoint's bytes in the W4A16 interleave with a float32 scale
per row. layout.py holds the words and their exact dequantization; packing.py re-packs compressed-tensors
and ModelOpt FP8 checkpoints' linears; linear.py is the GPU layer."""
