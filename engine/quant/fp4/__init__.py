"""NVFP4 and MXFP4 in one packed FP4 layout (E2M1 codes with the checkpoint's block-scale bytes; NVFP4 adds
a float32 scale per row). layout.py holds the words and their exact dequantization; slots.py re-lays them
into the code slots the tensor-core GEMV decodes fastest; packing.py re-packs a ModelOpt NVFP4 or MXFP4
checkpoint's linears; linear.py is the GPU layer."""
