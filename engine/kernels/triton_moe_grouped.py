"""A MoE layer's packed experts over a long step (a prefill chunk of more tokens than the routed GEMV takes), grouped
by expert on the device: the step's (token, expert) pairs sorted by expert, each expert's run cut into blocks of up
to BLOCK_M pairs, and one launch of the packed many-row GEMM (triton_packed_rows.packed_rows_kernel, GROUPED) over
every block: each block reads its expert's packed words once for all its pairs. The loop it replaces
(moe.routed_loop) reads the routing on the host and launches ~5 kernels an expert that got tokens: at route 2's
shape (256 experts, top 8) a 1,024-token prefill is ~40 layers x ~250 experts x 5 launches.

The schedule is built on the device (bincount, cumsum, searchsorted: no host read) for a fixed number of blocks, an
upper bound the host knows from the step's size: every expert's run adds at most one part-filled block. Blocks past
the last run hold expert -1 and return at once. Stacks as PackedExperts keeps them (row-major [E, N, K/8] words):
NVFP4 / MXFP4 with their block scales (and NVFP4's global scales), W4A16 with its (scale, zero) pairs interleaved.
A Triton kernel module (triton_support.py's rule): imported only where grouped_moe_take said the path can run.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton

from onecat.engine.kernels.triton_packed_rows import MXFP4, NVFP4, W4A16, packed_rows_kernel, slot_constants

BLOCK_M = 32  # pairs a block: a 1,024-token prefill of 256 experts, top 8, gives each expert ~32
BLOCK_N = 64
WARPS = 4


def grouped_schedule(ids: torch.Tensor, num_experts: int, block_m: int = BLOCK_M) -> tuple[torch.Tensor, torch.Tensor]:
    """(order, sched) for the step's pairs `ids` [P] (each pair's expert): order [P] the pairs sorted by expert (stable:
    tokens ascending within an expert), sched int32 [3, blocks] per block its expert (-1: none), its first place in
    `order` and its pair count (1..block_m)."""
    pairs = ids.numel()
    blocks = -(-pairs // block_m) + min(num_experts, pairs)
    counts = torch.bincount(ids, minlength=num_experts)
    order = ids.argsort(stable=True)
    per_expert = (counts + block_m - 1) // block_m
    ends = per_expert.cumsum(0)
    b = torch.arange(blocks, device=ids.device)
    expert = torch.searchsorted(ends, b, right=True)
    live = expert < num_experts
    e = expert.clamp(max=num_experts - 1)
    within = b - (ends[e] - per_expert[e])  # the block's place in its expert's run
    first = counts.cumsum(0)[e] - counts[e] + within * block_m
    count = (counts[e] - within * block_m).clamp(max=block_m)
    sched = torch.stack([torch.where(live, e, -1), first, torch.where(live, count, 0)]).to(torch.int32)
    return order, sched.contiguous()


def grouped_gemm(x: torch.Tensor, words: torch.Tensor, scales: torch.Tensor, second: torch.Tensor, fmt: int,
                 group: int, order: torch.Tensor, sched: torch.Tensor, x_div: int) -> torch.Tensor:
    """y [P, N]: pair p times its expert's weight, x row p // x_div (x [T, K]: top_k for the gate/up projection, whose
    pairs share their token's row; 1 for down, a row a pair). words int32 [E, N, K/8] row-major; fmt FP4's
    (NVFP4 0, MXFP4 1: scales uint8 [E, N, K/B], second NVFP4's float32 [E, N]) or W4A16 (scales = second = the
    (scale, zero) pairs [E, N, 2 K/G])."""
    _, n, kw = words.shape
    k = kw * 8
    y = torch.empty(order.numel(), n, dtype=x.dtype, device=x.device)
    packed_rows_kernel[(triton.cdiv(n, BLOCK_N), sched.shape[1])](
        x.contiguous(), words, scales, second, y, n, 0, order, sched, K=k, FMT=fmt,
        G=group if fmt == W4A16 else (16 if fmt == NVFP4 else 32), TILED=False, SLOTS=False, **slot_constants(None),
        BLOCK_N=BLOCK_N, BLOCK_M=BLOCK_M, STAGES=2, SPLIT=1, GROUPED=True, X_DIV=x_div, SZ_PAIRS=fmt == W4A16,
        num_warps=WARPS)
    return y


def grouped_experts(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, gate_up: tuple, down: tuple,
                    num_experts: int) -> torch.Tensor:
    """A MoE layer's routed experts over x [T, H] (`experts`, `weights` [T, k]: each token's experts and router
    weights), grouped by expert: gate/up of every pair, SiLU * mul, down of every pair, each token's pairs summed in
    float32 in its top-k order, weighted, rounded once. gate_up / down: (words, scales, second, format name, group)
    as PackedExperts._operands gives them."""
    tokens, top_k = experts.shape
    order, sched = grouped_schedule(experts.reshape(-1), num_experts)
    fmt = {"int4": W4A16, "nvfp4": NVFP4, "mxfp4": MXFP4}[gate_up[3]]
    h = grouped_gemm(x, *gate_up[:3], fmt, gate_up[4], order, sched, x_div=top_k)
    gate, up = h.split(h.shape[-1] // 2, dim=-1)
    y = grouped_gemm((F.silu(gate) * up).contiguous(), *down[:3], fmt, down[4], order, sched, x_div=1)
    return (y.view(tokens, top_k, -1).float() * weights.float().view(tokens, top_k, 1)).sum(dim=1).to(x.dtype)
