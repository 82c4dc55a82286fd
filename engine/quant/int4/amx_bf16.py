"""A packed layer's prompt rows on AMX bfloat16 tiles (csrc/cpu/amx_bf16_matmul.cpp; EngineArgs.cpu_prompt_matmul
"bf16").

A prompt's rows come hundreds at a time and are compute-bound; the int8 dot products that serve every other row
(int8_matmul.py) reach a fraction of what the tile unit does. The layer keeps a second copy of its weights for
them: the kernel's own values (s * q + c in float32) rounded to bfloat16 once at load, in the tiles' layout (2
bytes a weight next to the packed 0.625). The kernel sums every row over K in one fixed order with no other row
in its sum, so a prompt row's bits depend neither on its batch nor on its chunk.

Measured on a 2-core Intel Xeon with AMX (the embedded model's four projections, 30 layers' weights): 512 rows
2.8-2.9 ms a layer (1.3 TFLOPS), 2,048 rows 10.6-12.8 ms, against 24.6 ms on the int8 dot products and 13.4 ms
on oneDNN's blocked bf16 GEMM in the 128-row calls that keep its rows independent of their count. A [gate | up]
layer's SiLU(gate) * up runs in the kernel's epilogue (`silu_mul`); a 16 x 128-token prefill step went 1.0 s
(int8) -> 0.53 s (docs/server.md).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

TILE_COLUMNS = 16  # output columns of one B tile
TILE_K = 32  # values of K one TDPBF16PS sums


def unavailable_reason() -> str | None:
    """None where the AMX bf16 kernel runs here, else why not."""
    from onecat.engine.kernels import cpu_ops

    try:
        ops = cpu_ops.load()
    except RuntimeError as exc:
        return str(exc)
    return None if ops.amx_bf16_isa() else "this CPU (or its Linux kernel) offers no AMX-BF16 tiles"


def pack(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] weights (K % 32 == 0) as the kernel's bf16 tiles [ceil(N / 16), K / 32, 16 pairs of K, 16 columns,
    2]; N padded with zero rows to a multiple of 16."""
    n, k = weight.shape
    if k % TILE_K:
        raise ValueError(f"the AMX bf16 path needs K % {TILE_K} == 0, got K = {k}")
    w = F.pad(weight.float(), (0, 0, 0, -n % TILE_COLUMNS)).to(torch.bfloat16)
    tiles = w.shape[0] // TILE_COLUMNS
    return w.view(tiles, TILE_COLUMNS, k // TILE_K, TILE_K // 2, 2).permute(0, 2, 3, 1, 4).contiguous()


def matmul(x: torch.Tensor, packed: torch.Tensor, out_features: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (float32 or bf16) @ W.T in float32 [M, out_features]; written into `out` (a [M, out_features]
    float32 view with unit column stride, such as a row range of a larger result) where given."""
    from onecat.engine.kernels import cpu_ops

    ops = cpu_ops.load()
    if out is not None and out.shape[1] == packed.shape[0] * TILE_COLUMNS:
        return ops.amx_bf16_matmul(x.contiguous(), packed, out)
    y = ops.amx_bf16_matmul(x.contiguous(), packed, None)
    y = y if y.shape[1] == out_features else y[:, :out_features]
    if out is not None:
        out.copy_(y)
        return out
    return y


def silu_mul(x: torch.Tensor, packed: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """SiLU(x @ gate.T) * (x @ up.T) in float32 [M, width] for a [gate | up] layer's tiles (width % 16 == 0),
    computed in the kernel's epilogue (the same bits as silu_mul over `matmul`'s output); into `out` where given."""
    from onecat.engine.kernels import cpu_ops

    return cpu_ops.load().amx_bf16_silu_mul(x.contiguous(), packed, out)
