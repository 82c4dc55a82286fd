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

MOE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # what the fused MoE kernels (triton_moe.py) take


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
