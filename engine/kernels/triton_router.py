"""A MoE router's softmax, top-k and renormalization in one Triton program per token.

Why: at one token the torch ops (softmax, topk, sum, divide, the casts to the model dtype, to float32 and int32
for the fused experts) are seven or more launches a layer that each read a few hundred bytes. One program per
token holding its router logits in registers took a Qwen3-30B-A3B-shaped batch-1 step (CUDA graphs) from 3.99
to 3.11 ms on an H200 (benchmarks/results/gpu_h200_moe_hybrid.json "moe_fused_router"). Plain Triton ops, no
tensor-core instructions: it also builds for SM70 (not run there).

Numerics follow SparseMoE.route: softmax over all experts in float32; the k largest probabilities, largest
first, ties to the lower expert id (repeated argmax); optionally renormalized to sum to 1; then rounded to the
model dtype, as the checkpoint's reference does, and handed over as float32 (the fused experts' route
weights). Each token is its own program, so a token's weights do not depend on the batch.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from onecat.engine.kernels import pdl

MAX_EXPERTS = 1024  # router widths held in one program's registers
_ROUND = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}  # the model dtype the weights are rounded to


@triton.jit
def router_kernel(logits_ptr, weights_ptr, ids_ptr, num_experts, stride_t, TOP_K: tl.constexpr,
                  K_PAD: tl.constexpr, E_PAD: tl.constexpr, RENORM: tl.constexpr, ROUND: tl.constexpr,
                  PDL: tl.constexpr):
    if PDL:  # pdl.py: wait for the previous kernel, then let the next one start
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    t = tl.program_id(0)
    e = tl.arange(0, E_PAD)
    x = tl.load(logits_ptr + t * stride_t + e, mask=e < num_experts, other=float("-inf")).to(tl.float32)
    p = tl.exp(x - tl.max(x, 0))
    probs = tl.where(e < num_experts, p / tl.sum(p, 0), -1.0)
    slot = tl.arange(0, K_PAD)
    vals = tl.zeros([K_PAD], tl.float32)
    ids = tl.zeros([K_PAD], tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(probs, 0)
        pick = tl.min(tl.where(probs == best, e, E_PAD), 0)  # the lowest id among equal probabilities
        vals = tl.where(slot == j, best, vals)
        ids = tl.where(slot == j, pick, ids)
        probs = tl.where(e == pick, -1.0, probs)
    if RENORM:
        vals = vals / tl.sum(vals, 0)
    if ROUND == 1:  # the model dtype's rounding, carried in float32
        vals = vals.to(tl.float16).to(tl.float32)
    elif ROUND == 2:
        vals = vals.to(tl.bfloat16).to(tl.float32)
    keep = slot < TOP_K
    tl.store(weights_ptr + t * TOP_K + slot, vals, mask=keep)
    tl.store(ids_ptr + t * TOP_K + slot, ids, mask=keep)


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] float32 holding values of logits' dtype, expert ids [T, k] int32) of router logits [T, E]."""
    T, E = logits.shape
    if not 0 < top_k <= E <= MAX_EXPERTS:
        raise ValueError(f"the fused router takes 1 <= top_k <= num_experts <= {MAX_EXPERTS}, got k={top_k}, E={E}")
    logits = logits.contiguous()
    weights = torch.empty(T, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(T, top_k, dtype=torch.int32, device=logits.device)
    if T:
        router_kernel[(T,)](logits, weights, ids, E, logits.stride(0), TOP_K=top_k,
                            K_PAD=max(2, 1 << (top_k - 1).bit_length()), E_PAD=max(16, 1 << (E - 1).bit_length()),
                            RENORM=renormalize, ROUND=_ROUND[logits.dtype], num_warps=1 if E <= 256 else 4,
                            **pdl.options(logits.device))
    return weights, ids
