"""Runtime kernels: the Triton kernels (fused per-layer ops, batch-1 GEMV, paged decode) and the
build-on-demand loader of the CUDA extension in csrc/. Nothing is compiled at import. The offline
tools (sm_70 build check, toolchain, benchmarks, projections) live in engine/kernel_tools/."""
