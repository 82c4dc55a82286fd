"""Runtime kernels: the Triton kernels (fused per-layer ops, batch-1 GEMV, paged decode, packed-weight GEMVs,
MoE, router) and the build-on-demand loaders of the CUDA extensions in csrc/. Nothing is compiled at import,
and Triton is imported only where a kernel is launched (triton_support.py states the rule). The offline tools
(sm_70 build check, toolchain, benchmarks, projections) live in engine/kernel_tools/."""
