"""CPU linear layer whose per-row result does not depend on how many rows are computed together.

The library GEMM behind F.linear (MKL sgemm) picks its kernel from the row count: one row takes a
GEMV, a few rows a small-matrix kernel, 16 or more the packed GEMM, and each sums over K in its own
order. So the same token got different fp32 results (up to ~5e-6 here) in a decode step of one
sequence, of three, or in a prefill, and any later rounding (an fp8 KV cache, a greedy argmax near a
tie) turned that into different tokens.

oneDNN's matmul on weights reordered to its blocked layout (brgemm) keeps one accumulator per output
and walks K in one fixed order whatever the row count; the one exception is a single row with
K > 1024, which takes another kernel, so such a row is sent twice (one row is bandwidth-bound: the
copy costs little). Its fused bias is not row-count invariant, so the bias is added apart. Checked
bitwise for 1..4096 rows, K up to 8960 and 1..7 threads.

Where the CPU has AVX2 + FMA without AVX512 the layers take the one-pass rows kernel instead
(engine/kernels/f32_rows.py): invariant by construction, and it streams the weights once for a decode or verify
step's few rows. One kernel serves every layer of a process, so prompt and decode rows agree.
"""
from __future__ import annotations

import torch
from torch import nn

from onecat.engine.kernels import f32_rows
from onecat.engine.kernels.onednn import onednn_blocked, onednn_matmul

ONE_ROW_KERNEL_ABOVE_K = 1024
ONEDNN = torch.backends.mkldnn.is_available()


def supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.dtype is torch.float32 and weight.dtype is torch.float32 and ONEDNN


class _PackedWeight:
    """The weight in the kernel's layout (the rows kernel's tiles, or oneDNN's blocked layout), and which dense
    weight it was made from (a meta tensor once the dense copy is dropped: then this is the only copy)."""

    def __init__(self, weight: torch.Tensor):
        self.rows = f32_rows.unavailable_reason() is None
        self.shape = tuple(weight.shape)
        self.blocked = f32_rows.pack(weight) if self.rows else onednn_blocked(weight)
        self.source = self._key(weight)

    @staticmethod
    def _key(weight: torch.Tensor) -> tuple:
        # an inference tensor (a stack built while drafting) has no version counter; it is rebuilt, not changed
        return (weight.data_ptr(), 0 if weight.is_inference() else weight._version, tuple(weight.shape))

    def matches(self, weight: torch.Tensor) -> bool:
        return weight.is_meta or self.source == self._key(weight)


def batch_invariant_linear(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """module(x) for float32 on CPU, each output row independent of the other rows of x."""
    return invariant_matmul(module, module.weight, module.bias, x)


def invariant_matmul(owner: nn.Module, weight: torch.Tensor, bias: torch.Tensor | None,
                     x: torch.Tensor) -> torch.Tensor:
    """F.linear(x, weight, bias) as batch_invariant_linear computes it, the weight's packed form kept on `owner`
    (repacked when the weight changes): a layer's own weight, or one no layer holds (a drafter's stacked q/k/v)."""
    packed = getattr(owner, "_batch_invariant_weight", None)
    if packed is None or not packed.matches(weight):
        packed = _PackedWeight(weight)
        owner._batch_invariant_weight = packed
    flat = x.dim() == 2 and x.is_contiguous()  # a step's rows as they come: no reshape, no view back
    lead, k = x.shape[:-1], x.shape[-1]
    rows = x if flat else x.reshape(-1, k).contiguous()
    if rows.shape[0] == 0:
        return x.new_empty(*lead, packed.shape[0])
    if packed.rows:
        out = f32_rows.matmul(rows, packed.blocked, packed.shape[0])
    else:
        one = rows.shape[0] == 1 and k > ONE_ROW_KERNEL_ABOVE_K
        out = onednn_matmul(rows.expand(2, k).contiguous() if one else rows, packed.blocked)
        if one:
            out = out[:1]
    if bias is not None:
        out = out.add_(bias)
    return out if flat else out.view(*lead, -1)


def pack_weight(module: nn.Linear, keep_dense: bool) -> None:
    """Reorder module's float32 CPU weight into the blocked layout now. Without keep_dense its dense
    parameter becomes a meta tensor of the same shape: the blocked copy is then the only one, so
    packing costs no memory."""
    module._batch_invariant_weight = _PackedWeight(module.weight)
    if not keep_dense:
        module.weight = nn.Parameter(torch.empty(module.weight.shape, device="meta"), requires_grad=False)


def dense_weight(module: nn.Linear) -> torch.Tensor | None:
    """The module's dense [N, K] weight, also when pack_weight dropped it: read back from the packed copy (the rows
    kernel's tiles rearranged; oneDNN's as I @ W^T, exact: each output sums one nonzero product). None for a
    module with neither."""
    if not module.weight.is_meta:
        return module.weight.data
    packed = getattr(module, "_batch_invariant_weight", None)
    if packed is None:
        return None
    n, k = module.weight.shape
    if packed.rows:
        return f32_rows.unpack(packed.blocked, n, k)
    return onednn_matmul(torch.eye(k, dtype=torch.float32), packed.blocked).T.contiguous()
