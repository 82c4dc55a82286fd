"""Fused MoE experts on CUDA (Triton): a step's experts as two grouped GEMMs over its (token, expert) pairs
sorted by expert, the scheme of vLLM's fused_moe.

`align` sorts the T*k pairs by expert and pads each expert's run to a multiple of the row block, so every
row block of the sorted list belongs to one expert (`block_experts`); padding rows hold the sentinel T*k.
It runs on the device with no host sync (the launch size is an upper bound; blocks past the real total
exit at once), so the step stays capturable in a CUDA graph.

  gate_up  each program: one row block x a column block of the intermediate size; it multiplies the
           block's token rows by its expert's gate rows and up rows (two accumulators) and writes
           SiLU(gate) * up per pair, each product rounded to the model dtype first as the unfused layer does.
  down     the same over down_proj, scaled by each pair's router weight, one output row per pair;
           the k rows of a token are then summed (in float32, rounded once).

Up to triton_moe_gemv.MAX_TOKENS tokens (decode) the experts run as per-pair GEMVs instead (that module):
no sort, no padding, a token's sums the same in any batch of that size.

Two variants of the inner product: `dot` (tl.dot: tensor cores on SM80+) and `fma` (float32 multiply-adds, no
matrix instructions, so it also runs on SM70, where Triton has no tensor-core dot). The fma variant keeps a
[BM, BK, BN] accumulator of partial products and reduces over BK once after the K loop: Triton rewrites
sum(a[:, :, None] * b[None, :, :], axis=1) into a dot (tf32 tensor cores for float32 on SM80+), so reducing
inside the loop would not be FMA-only.
The tile sizes are a fixed function of the pair count and variant (no autotuning). Whether the fused path
takes a call: triton_support.moe_unavailable_reason.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from onecat.engine.kernels import pdl, triton_moe_gemv

VARIANTS = ("dot", "fma")
COMBINE_BLOCK = 1024  # hidden features a program of the k-slot sum takes
DECODE_GEMV = True  # up to triton_moe_gemv.MAX_TOKENS tokens take its GEMVs (the switch benchmarks flip to compare)


def default_variant(device: torch.device) -> str:
    return "dot" if torch.cuda.get_device_capability(device)[0] >= 8 else "fma"


def max_padded_rows(pairs: int, num_experts: int, block_m: int) -> int:
    """Rows of the sorted, padded pair list in the worst case: at most min(E, pairs) experts get pairs, and
    each pads fewer than block_m rows."""
    rows = pairs + min(num_experts, pairs) * (block_m - 1)
    return -(-rows // block_m) * block_m


def align(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [T, k] expert per (token, slot) -> (sorted pair indices [P] (token * k + slot; T*k = padding),
    block_experts [P // block_m] (the expert of each row block; num_experts = past the end)). On the device,
    no host sync; pairs of one expert keep ascending pair order."""
    flat = ids.reshape(-1).to(torch.int64)
    n = flat.numel()
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    pad = (block_m - counts % block_m) % block_m  # rows each expert's run is padded by
    shift = pad.cumsum(0) - pad  # padding rows before each expert's run
    order = flat.argsort(stable=True)
    rows = max_padded_rows(n, num_experts, block_m)
    sorted_pairs = torch.full((rows,), n, dtype=torch.int32, device=flat.device)
    sorted_pairs[torch.arange(n, device=flat.device) + shift[flat[order]]] = order.to(torch.int32)
    padded_end = (counts + pad).cumsum(0)
    block_starts = torch.arange(0, rows, block_m, device=flat.device)
    block_experts = torch.searchsorted(padded_end, block_starts, right=True).to(torch.int32)
    return sorted_pairs, block_experts


@triton.jit(do_not_specialize=["n_pairs"])  # one build for every pair count (triton_builds.py says why)
def gate_up_kernel(x_ptr, w_ptr, out_ptr, pairs_ptr, experts_ptr, n_pairs, top_k, num_experts, N,
                   stride_x, stride_we, stride_wn, stride_o,
                   K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, USE_DOT: tl.constexpr,
                   PRECISION: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # pdl.py: wait for the previous kernel, then let the next one start
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    pid = tl.program_id(0)
    n_blocks = tl.cdiv(N, BN)
    pid_m, pid_n = pid // n_blocks, pid % n_blocks
    e = tl.load(experts_ptr + pid_m).to(tl.int64)
    if e >= num_experts:
        return
    pair = tl.load(pairs_ptr + pid_m * BM + tl.arange(0, BM)).to(tl.int64)
    row_ok = pair < n_pairs
    tok = tl.where(row_ok, pair // top_k, 0)
    cols = pid_n * BN + tl.arange(0, BN)
    col_ok = cols < N
    ks = tl.arange(0, BK)
    a_ptrs = x_ptr + tok[:, None] * stride_x + ks[None, :]
    g_ptrs = w_ptr + e * stride_we + tl.where(col_ok, cols, 0)[None, :] * stride_wn + ks[:, None]
    u_ptrs = g_ptrs + N * stride_wn
    if USE_DOT:
        acc_g = tl.zeros([BM, BN], dtype=tl.float32)
        acc_u = tl.zeros([BM, BN], dtype=tl.float32)
    else:  # per-k partial products, reduced once after the loop (see the module docstring)
        acc_g = tl.zeros([BM, BK, BN], dtype=tl.float32)
        acc_u = tl.zeros([BM, BK, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        k_ok = ks < K - k0
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        g = tl.load(g_ptrs, mask=k_ok[:, None], other=0.0)
        u = tl.load(u_ptrs, mask=k_ok[:, None], other=0.0)
        if USE_DOT:
            acc_g = tl.dot(a, g, acc_g, input_precision=PRECISION)
            acc_u = tl.dot(a, u, acc_u, input_precision=PRECISION)
        else:  # no matrix instructions (SM70): float32 multiply-adds
            af = a.to(tl.float32)[:, :, None]
            acc_g += af * g.to(tl.float32)[None, :, :]
            acc_u += af * u.to(tl.float32)[None, :, :]
        a_ptrs += BK
        g_ptrs += BK
        u_ptrs += BK
    if not USE_DOT:
        acc_g = tl.sum(acc_g, axis=1)
        acc_u = tl.sum(acc_u, axis=1)
    dt = out_ptr.dtype.element_ty
    gate = acc_g.to(dt).to(tl.float32)  # the projection's output rounding, as the unfused layer
    act = (gate / (1.0 + tl.exp(-gate))).to(dt)
    h = act * acc_u.to(dt)
    tl.store(out_ptr + pair[:, None] * stride_o + cols[None, :], h, mask=row_ok[:, None] & col_ok[None, :])

@triton.jit(do_not_specialize=["n_pairs"])  # one build for every pair count (triton_builds.py says why)
def down_kernel(h_ptr, w_ptr, out_ptr, pairs_ptr, experts_ptr, route_ptr, n_pairs, num_experts, N, stride_h,
                stride_we, stride_wn, stride_o,
                K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, USE_DOT: tl.constexpr,
                PRECISION: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # pdl.py: wait for the previous kernel, then let the next one start
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    pid = tl.program_id(0)
    n_blocks = tl.cdiv(N, BN)
    pid_m, pid_n = pid // n_blocks, pid % n_blocks
    e = tl.load(experts_ptr + pid_m).to(tl.int64)
    if e >= num_experts:
        return
    pair = tl.load(pairs_ptr + pid_m * BM + tl.arange(0, BM)).to(tl.int64)
    row_ok = pair < n_pairs
    safe = tl.where(row_ok, pair, 0)
    cols = pid_n * BN + tl.arange(0, BN)
    col_ok = cols < N
    ks = tl.arange(0, BK)
    a_ptrs = h_ptr + safe[:, None] * stride_h + ks[None, :]
    b_ptrs = w_ptr + e * stride_we + tl.where(col_ok, cols, 0)[None, :] * stride_wn + ks[:, None]
    if USE_DOT:
        acc = tl.zeros([BM, BN], dtype=tl.float32)
    else:
        acc = tl.zeros([BM, BK, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        k_ok = ks < K - k0
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None], other=0.0)
        if USE_DOT:
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
        else:
            acc += a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :]
        a_ptrs += BK
        b_ptrs += BK
    if not USE_DOT:
        acc = tl.sum(acc, axis=1)
    scale = tl.load(route_ptr + safe, mask=row_ok, other=0.0).to(tl.float32)
    y = acc.to(out_ptr.dtype.element_ty).to(tl.float32) * scale[:, None]
    tl.store(out_ptr + pair[:, None] * stride_o + cols[None, :], y.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])

@triton.jit
def combine_kernel(y_ptr, out_ptr, H, TOP_K: tl.constexpr, BH: tl.constexpr, PDL: tl.constexpr):
    """out[t] = sum over slots j = 0, 1, ... of y[t * TOP_K + j], in float32 in that order (one kernel; the
    same order at every batch size)."""
    if PDL:  # pdl.py: wait for the previous kernel, then let the next one start
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BH + tl.arange(0, BH)
    ok = h < H
    acc = tl.zeros([BH], tl.float32)
    for j in tl.static_range(TOP_K):
        acc += tl.load(y_ptr + (t * TOP_K + j) * H + h, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * H + h, acc.to(out_ptr.dtype.element_ty), mask=ok)


def takes_gemv(tokens: int) -> bool:
    """Whether a call of this many tokens runs as triton_moe_gemv's per-pair GEMVs."""
    return DECODE_GEMV and tokens <= triton_moe_gemv.MAX_TOKENS


def tiles(pairs: int, variant: str) -> dict:
    """Tile sizes: small row blocks for decode (few pairs per expert), larger for prefill."""
    if variant == "fma":
        return dict(BM=16, BN=32, BK=8, num_warps=4, num_stages=2)
    if pairs <= 256:
        return dict(BM=16, BN=32, BK=128, num_warps=4, num_stages=4)
    if pairs <= 4096:
        return dict(BM=32, BN=64, BK=64, num_warps=4, num_stages=3)
    return dict(BM=64, BN=128, BK=64, num_warps=8, num_stages=3)


def down_tiles(pairs: int, variant: str) -> dict:
    """The down kernel's column tile, K tile, warps and stages where they differ from `tiles`: at decode pair
    counts a K tile of 64 and six stages (K is the expert's intermediate size, a few hundred: the pipeline sets
    the pace; benchmarks/results/gpu_h200_moe_hybrid.json "moe_expert_tiles_one_token"). Row blocks stay those
    of `tiles`, and every pair count of the tier shares them, so a token's sums do not depend on the batch there."""
    if variant == "dot" and pairs <= 256:
        return dict(BN=32, BK=64, num_warps=2, num_stages=6)
    t = tiles(pairs, variant)
    return {k: t[k] for k in ("BN", "BK", "num_warps", "num_stages")}


def fused_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor,
                  ids: torch.Tensor, variant: str | None = None) -> torch.Tensor:
    """x [T, H]; gate_up [E, 2I, H] ([gate | up] rows); down [E, H, I]; weights, ids [T, k] (router weights and
    experts) -> [T, H]: sum over k of weight * down(SiLU(gate x) * up x)."""
    variant = variant or default_variant(x.device)
    if variant not in VARIANTS:
        raise ValueError(f"fused MoE variant {variant!r}: choose one of {', '.join(VARIANTS)}")
    E, two_i, H = gate_up.shape
    inter = two_i // 2
    if x.dim() != 2 or x.shape[1] != H or down.shape != (E, H, inter) or ids.shape != weights.shape \
            or ids.shape[0] != x.shape[0]:
        raise ValueError(f"fused MoE shapes do not match: x {tuple(x.shape)}, gate_up {tuple(gate_up.shape)}, "
                         f"down {tuple(down.shape)}, weights {tuple(weights.shape)}, ids {tuple(ids.shape)}")
    if gate_up.dtype != x.dtype or down.dtype != x.dtype:
        raise ValueError(f"fused MoE needs one dtype: x {x.dtype}, gate_up {gate_up.dtype}, down {down.dtype}")
    T, top_k = ids.shape
    if T == 0:
        return torch.empty_like(x)
    x, gate_up, down = x.contiguous(), gate_up.contiguous(), down.contiguous()
    n = T * top_k
    if takes_gemv(T):
        return triton_moe_gemv.fused_experts(x, gate_up, down, weights, ids)
    t = tiles(n, variant)
    bm, bn, bk = t["BM"], t["BN"], t["BK"]
    pairs, block_experts = align(ids, E, bm)
    h = torch.empty(n, inter, dtype=x.dtype, device=x.device)
    y = torch.empty(n, H, dtype=x.dtype, device=x.device)
    route = weights.reshape(-1).to(torch.float32).contiguous()
    launch = pdl.options(x.device)
    common = dict(BM=bm, BK=bk, USE_DOT=variant == "dot", PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
                  num_warps=t["num_warps"], num_stages=t["num_stages"], **launch)
    m_blocks = block_experts.numel()
    gate_up_kernel[(m_blocks * -(-inter // bn),)](
        x, gate_up, h, pairs, block_experts, n, top_k, E, inter, x.stride(0), gate_up.stride(0),
        gate_up.stride(1), h.stride(0), K=H, BN=bn, **common)
    out = torch.empty_like(x)
    down_t = dict(common, **down_tiles(n, variant))
    dn = down_t.pop("BN")
    down_kernel[(m_blocks * -(-H // dn),)](
        h, down, y, pairs, block_experts, route, n, E, H, h.stride(0), down.stride(0), down.stride(1), y.stride(0),
        K=inter, BN=dn, **down_t)
    combine_kernel[(T, -(-H // COMBINE_BLOCK))](y, out, H, TOP_K=top_k, BH=COMBINE_BLOCK, num_warps=4, **launch)
    return out
