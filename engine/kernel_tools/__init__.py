"""Offline kernel tools for `onecat kernels`: the sm_70 build check without a GPU (CUDA 12.x toolchain,
NVRTC), the kernel benchmark and the V100 roofline projection. The engine never imports these at
run time; they import the runtime kernels of engine/kernels/."""
