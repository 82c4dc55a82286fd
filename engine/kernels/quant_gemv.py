"""The CUDA packed-weight GEMV (csrc/quant_gemv/quant_gemv.cuh): W4A16, NVFP4, MXFP4 and FP8 weights read
packed, 1-8 activation rows, plain FMAs (SM70 and newer). Built on first use; where it cannot be built the
layers fall back to the Triton GEMVs (engine/kernels/triton_w4a16.py, triton_fp4.py), and `backend()` says
which runs and why.

ONECAT_QUANT_GEMV=triton keeps the Triton GEMVs (for comparison); unset or "cuda" prefers this one.
"""
from __future__ import annotations

import functools
import os

import torch

from onecat.engine.kernels.cuda_extension import CSRC, CudaExtension

BACKEND_ENV = "ONECAT_QUANT_GEMV"
BACKENDS = ("cuda", "triton")
MAX_ROWS = 8
FMT_IDS = {"int4_fp16": 0, "int4_bf16": 1, "nvfp4": 2, "mxfp4": 3, "fp8": 4}
TICKETS = 1 << 16  # row tiles of one call (>= N / 16)
# --ftz=false: the W4A16 decode multiplies float32 denormals (a code masked in place), which must not flush
EXTENSION = CudaExtension("onecat_quant_gemv", (CSRC / "bindings" / "quant_gemv.cpp", CSRC / "bindings" / "quant_gemv_launch.cu"), ("quant_gemv", "bindings"),
                          cuda_flags=("--ftz=false",))


def backend() -> tuple[str, str]:
    """("cuda" or "triton", why): the GEMV the packed layers call on this machine."""
    want = os.environ.get(BACKEND_ENV, "cuda").strip().lower() or "cuda"
    if want not in BACKENDS:
        raise ValueError(f"{BACKEND_ENV}={want!r}: expected one of {', '.join(BACKENDS)}")
    if want == "triton":
        return "triton", f"{BACKEND_ENV}=triton"
    reason = EXTENSION.unavailable_reason()
    return ("cuda", "CUDA packed GEMV built") if reason is None else ("triton", f"CUDA packed GEMV unavailable: {reason}")


@functools.lru_cache(maxsize=None)
def use_cuda() -> bool:
    return backend()[0] == "cuda"


@functools.lru_cache(maxsize=None)
def _tickets(device_index: int) -> torch.Tensor:
    """Per-device split-K tickets: zero between calls (the last block of a row tile resets its own)."""
    return torch.zeros(TICKETS, dtype=torch.int32, device=torch.device("cuda", device_index))


def packed_gemv(x: torch.Tensor, fmt: str, qweight: torch.Tensor, scales: torch.Tensor,
                row_scale: torch.Tensor | None = None, group: int = 0, splits: int = 0) -> torch.Tensor:
    """y = x @ dequant(W)^T for a contiguous fp16/bf16 x of 1-8 rows (leading shape kept). fmt: "int4" (scales
    = W4A16 (scale, zero) pairs [N, K/G, 2] in fp16 or bf16, group G), "nvfp4" (scales = E4M3 bytes, row_scale
    = global scale per row), "mxfp4" (E8M0 bytes), "fp8" (row_scale = scale per row; scales unused).
    splits: runs of K per row tile (0: the kernel's choice)."""
    if fmt == "int4":
        fmt = "int4_fp16" if scales.dtype == torch.float16 else "int4_bf16"
    mod = EXTENSION.load()
    device = x.device.index if x.device.index is not None else torch.cuda.current_device()
    return mod.gemv(x, qweight, scales if fmt != "fp8" else row_scale, row_scale, _tickets(device), FMT_IDS[fmt],
                    group, splits)
