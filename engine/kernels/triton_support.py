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
# the packed many-row GEMM (triton_packed_rows.py) takes a layer's calls past its GEMV rows (quant_gemv.blocked_rows)
# up to PACKED_ROWS_UP_TO[words format] rows; more (a prefill's) dequantize the weight for the library GEMM. Timed
# against that dequantizing path on an H100 over the Qwen3.5-27B projections (benchmarks/results/
# gpu_packed_rows_{nvfp4,w4a16}_h100.json): NVFP4 1.7-2.5x at 17-64 rows, 1.1-1.5x at 128 on four projections and
# even on the fifth; W4A16 1.3-2.0x at 17-32 rows, ahead at 64 on four of five, behind on all five at 128. MXFP4
# shares NVFP4's kernel (a cheaper decode) and is not timed apart; FP8 is not timed past 16 rows: not taken.
PACKED_ROWS_UP_TO = {"nvfp4": 128, "mxfp4": 128, "int4": 64}
PACKED_ROWS = (17, 128)  # the most the kernel takes (its tiles' BLOCK_M), and the fewest a layer sends it
# ONECAT_PACKED_ROWS_GEMM (read once; benchmarks set it per process): unset the table above, 1 every format at
# PACKED_ROWS, 0 never (the A/B arm)
PACKED_ROWS_GEMM = switch("ONECAT_PACKED_ROWS_GEMM", None)
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


def packed_rows_up_to(words_format: str) -> int:
    """The most rows of a layer whose words are `words_format` the packed many-row GEMM takes (0: none), by
    ONECAT_PACKED_ROWS_GEMM and PACKED_ROWS_UP_TO."""
    if PACKED_ROWS_GEMM is None:
        return PACKED_ROWS_UP_TO.get(words_format, 0)
    return PACKED_ROWS[1] if PACKED_ROWS_GEMM else 0


def packed_rows_take(x: torch.Tensor, in_features: int, rows: int, words_format: str) -> bool:
    """Whether a packed layer's call of `rows` rows takes the packed many-row GEMM (triton_packed_rows.py): the
    rows are fp16/bf16 CUDA rows from PACKED_ROWS[0] to packed_rows_up_to(words_format), K a multiple of 128, an
    SM80+ GPU and Triton usable."""
    if not (x.is_cuda and PACKED_ROWS[0] <= rows <= packed_rows_up_to(words_format) and in_features % 128 == 0
            and x.dtype in (torch.float16, torch.bfloat16)):
        return False
    return _packed_rows_gpu(x)


def _packed_rows_gpu(x: torch.Tensor) -> bool:
    """x's GPU can run the packed many-row GEMM's tiles: SM80+ and Triton usable."""
    from onecat.engine.kernels.device import capability

    index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    return capability(index) >= PACKED_ROWS_MIN_CAPABILITY and triton_unavailable_reason() is None


def grouped_moe_take(x: torch.Tensor, widths: tuple[int, ...]) -> bool:
    """Whether a MoE layer's long step may run its packed experts grouped by expert (triton_moe_grouped.py: the
    packed many-row GEMM's tiles): fp16/bf16 CUDA rows, every projection's K (`widths`) a multiple of 128, an SM80+
    GPU and Triton usable."""
    if not (x.is_cuda and x.dtype in (torch.float16, torch.bfloat16) and all(k % 128 == 0 for k in widths)):
        return False
    return _packed_rows_gpu(x)
