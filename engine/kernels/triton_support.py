"""Whether Triton can be used here (asked once), and the one way onecat's Triton modules are built and reached.

The convention, for every Triton kernel module (engine/kernels/triton_*.py, engine/parallel/peer_collectives.py):
  - it imports `triton` and `triton.language as tl` at its top and defines its kernels as plain module-level
    `@triton.jit` functions, next to the Python functions that launch them (no factories building kernels
    on first call: a kernel reads as it compiles);
  - no module imports it at its top except another Triton kernel module: the code that launches a kernel
    imports the module inside that function, on a path where Triton was found usable
    (`triton_unavailable_reason()` below, or a check built on it, returned None). So `import onecat.engine`
    works where Triton is absent, and nothing about Triton is paid until a kernel is wanted;
  - what callers decide with before that (whether a path can run: the checks here; device facts: device.py)
    needs no Triton.
The offline sm_70 build (engine/kernel_tools/triton_sm70.py) compiles the same module-level kernels with
`triton.compile`, no GPU needed; under TRITON_INTERPRET=1 (set before the module is first imported) Triton's
interpreter runs them on CPU.
"""
from __future__ import annotations

import functools

import torch

from onecat.engine.switches import switch

MOE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # what the fused MoE kernels (triton_moe.py) take
# the packed many-row GEMM (triton_packed_rows.py): on with ONECAT_PACKED_ROWS_GEMM=1 (read once; benchmarks set it
# per process) until its GPU test has run; the rows it takes (1-16: the packed GEMV; more: a prefill's, which the
# dequantized weight and the library GEMM serve well) and the GPUs (tl.dot on fp16/bf16 tiles)
PACKED_ROWS_GEMM = switch("ONECAT_PACKED_ROWS_GEMM", False)
PACKED_ROWS = (17, 128)
PACKED_ROWS_MIN_CAPABILITY = 80


@functools.lru_cache(maxsize=1)
def triton_unavailable_reason() -> str | None:
    try:
        import triton  # noqa: F401
    except Exception as e:  # ImportError, or a broken install
        return f"triton is not importable ({type(e).__name__}: {e})"
    return None


def fused_unavailable_reason() -> str | None:
    """Why the fused per-layer kernels (triton_fused.py, triton_gemv.py) cannot run here (None: they can)."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    return triton_unavailable_reason()


def moe_unavailable_reason(x: torch.Tensor) -> str | None:
    """Why the fused MoE experts (triton_moe.py) cannot run on x (None: they can)."""
    if x.device.type != "cuda":
        return f"input is on {x.device}, not a CUDA device"
    if x.dtype not in MOE_DTYPES:
        return f"dtype {x.dtype} unsupported (float16, bfloat16 or float32)"
    return triton_unavailable_reason()


def packed_rows_take(x: torch.Tensor, in_features: int, rows: int) -> bool:
    """Whether a packed layer's call of `rows` rows takes the packed many-row GEMM (triton_packed_rows.py): it is
    on, the rows are PACKED_ROWS' fp16/bf16 CUDA rows, K a multiple of 128, an SM80+ GPU and Triton usable."""
    if not (PACKED_ROWS_GEMM and x.is_cuda and PACKED_ROWS[0] <= rows <= PACKED_ROWS[1] and in_features % 128 == 0
            and x.dtype in (torch.float16, torch.bfloat16)):
        return False
    from onecat.engine.kernels.device import capability

    index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    return capability(index) >= PACKED_ROWS_MIN_CAPABILITY and triton_unavailable_reason() is None
