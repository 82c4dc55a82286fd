"""Float32 CPU matmul that streams a layer's weights once for all its rows (csrc/cpu/f32_rows.cpp, AVX2 + FMA).

A decode step, a speculative verify step (1 + k rows) and a drafter's block multiply a few rows by every weight
of the model. oneDNN's blocked GEMM (engine/kernels/onednn.py) costs ~1.4-1.6x more at 8 rows than at one on an
AVX2-only CPU, and reads one row's weights at well below the memory's rate; this kernel streams them once for
all the rows: on a 2-core AMD EPYC without AVX512, one step's projections of the embedded model (weights of 30
layers, so from memory as in a step) took 0.57x oneDNN's time at one row, 0.60x at 8, 0.69x at 16 and 0.90x at
256 (benchmarks/cpu_f32_rows.py, results/cpu_f32_rows_epyc_avx2.json); the float32 engine's batch-1 decode went
from 21.5 to 35.7 tok/s there (contracts/smollm2_dflash.yaml's target-only arm).

Each output is one chain of fused multiply-adds over K in order, so a row's bits depend on nothing else: not
the row count (a prompt's rows and a decode row agree), the other rows, the thread split or the vector width
(the portable loop gives the same bits). Layout: output columns in tiles of 8, each tile K-major, [tiles, K +
pad, 8]; the pad rows keep the tiles' starts off a common 4 KB offset (without them the tiles of a K = 1536
projection, 48 KB apart, ran a one-row call about twice as slow). The kernel is chosen once per process.
A weight whose every value is a bfloat16 number (a bf16 checkpoint run in float32, as the DFlash drafter that
ships with the engine is) is packed as bfloat16: the kernel widens each weight to the same float32, so the bits
are those of the float32 packing and the call streams half the bytes (ONECAT_CPU_F32_ROWS_BF16=0 keeps float32).
"""
from __future__ import annotations

import functools

import torch

from onecat.engine.switches import switch

LANES = 8  # output columns per tile: one 256-bit register of float32
# weights that are all bfloat16 numbers packed as bfloat16 (the same bits, half the bytes): 1 on, 0 off (read once)
BF16_WEIGHTS = switch("ONECAT_CPU_F32_ROWS_BF16", True)


@functools.cache
def unavailable_reason() -> str | None:
    """None where float32 CPU layers take this kernel here, else why not (then they keep oneDNN's GEMM)."""
    # float32 CPU layers on the one-pass rows kernel: 1 on, 0 off (oneDNN's blocked GEMM); unset: on where the CPU
    # has AVX2 + FMA but no AVX512F (where it was measured against oneDNN; with AVX512 oneDNN keeps them)
    wanted = switch("ONECAT_CPU_F32_ROWS", None)
    if wanted is False:
        return "ONECAT_CPU_F32_ROWS=0"
    from onecat.engine.kernels import cpu_ops

    if wanted is None and "avx512f" in cpu_ops.cpu_flags():
        return "this CPU has AVX512F, where oneDNN's GEMM is kept (ONECAT_CPU_F32_ROWS=1 takes the kernel)"
    try:
        ops = cpu_ops.load()
    except RuntimeError as exc:
        return str(exc)
    return None if ops.f32_rows_isa() else "this CPU has no AVX2 + FMA"


def pad_rows(k: int) -> int:
    """Rows of padding after each tile's K rows: a tile is (K + pad) * 32 bytes (16 in bfloat16), never a multiple
    of 4 KB."""
    return 2 if (k + 2) % 128 else 4


def bf16_exact(weight: torch.Tensor) -> bool:
    """Whether every value of the float32 weight is a bfloat16 number, so that packing it as bfloat16 loses nothing."""
    return bool(torch.equal(weight, weight.to(torch.bfloat16).float()))


def pack(weight: torch.Tensor, narrow: bool | None = None) -> torch.Tensor:
    """[N, K] float32 -> [tiles, K + pad, 8] (padding columns and rows are zeros), in bfloat16 where `narrow`
    (None: where every weight is a bfloat16 number and ONECAT_CPU_F32_ROWS_BF16 is not 0)."""
    weight = weight.detach()
    if narrow is None:
        narrow = BF16_WEIGHTS and bf16_exact(weight)
    n, k = weight.shape
    tiles = -(-n // LANES)
    padded = weight.new_zeros(tiles * LANES, k + pad_rows(k), dtype=torch.bfloat16 if narrow else torch.float32)
    padded[:n, :k] = weight
    return padded.view(tiles, LANES, -1).transpose(1, 2).contiguous()


def unpack(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """pack's inverse: the [N, K] float32 weight."""
    return packed.transpose(1, 2).reshape(-1, packed.shape[1])[:n, :k].float().contiguous()


@functools.cache
def _ops():
    from onecat.engine.kernels import cpu_ops

    return cpu_ops.load()


def matmul(rows: torch.Tensor, packed: torch.Tensor, n: int, portable: bool = False) -> torch.Tensor:
    """rows [M, K] float32 times the packed weight's transpose -> [M, N]; `portable`: the scalar loop (same bits)."""
    out = _ops().f32_rows_matmul(rows, packed, portable)
    return out if out.shape[1] == n else out[:, :n].contiguous()
