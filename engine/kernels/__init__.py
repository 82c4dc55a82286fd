"""Custom CUDA kernels: built on demand (never at import), plus an offline sm_70 resource check."""
