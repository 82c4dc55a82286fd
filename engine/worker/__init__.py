"""The worker executes: it loads the model, sizes and creates its KV and recurrent-state caches, sets up
fused kernels, CUDA graphs and tensor-parallel ranks, and runs the steps the engine core schedules."""
