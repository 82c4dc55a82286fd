"""nn.Linear with a batch-1 decode path: a single row on CUDA (fused kernels on) goes through the
bandwidth-bound GEMV of engine/kernels/triton_gemv.py instead of the library GEMM (so do the rows of a
step whose forward context allows more: the GEMV computes each row as if alone, so a batch-1 verify
step's rows equal batch-1 decode bit for bit); 2-32 rows on CUDA (a verify step, a drafter's block, a
small batch) take the library GEMM, or with ONECAT_DENSE_ROWS_GEMV=1 (2-16 rows, SM80+) the tensor-core GEMV
of engine/kernels/dense_rows.py, or with ONECAT_ROWS_GEMM=1 the few-row GEMM of
engine/kernels/triton_rows_gemm.py (measured no faster end to end on an H100:
benchmarks/results/speculative_gpu_rounds_h100_rows_gemm_ab.json); float32 on CPU goes through the
batch-invariant matmul of batch_invariant_linear.py; everything else is F.linear.

`norm_then_linear` also folds the residual add + RMSNorm before a projection (and, for the MLP's
gate/up projection, the SiLU*mul after it) into that GEMV (the rows GEMV and GEMM take only the SiLU*mul), or
into the packed layers' CUDA GEMV (their `fused_norm_gemv`); for any other module or input it runs the
steps one after the other. `pack_weights` prepares a CPU model's float32 layers for the batch-invariant
matmul.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from onecat.engine.attention.forward_context import gemv_row_limit
from onecat.engine.kernels import dense_rows
from onecat.engine.layers import batch_invariant_linear
from onecat.engine.switches import switch


# the few-row GEMM for 2-32 fp16/bf16 CUDA rows (triton_rows_gemm.py): measured no faster than the library GEMM, so
# off (read once: benchmarks set it per process)
ROWS_GEMM = switch("ONECAT_ROWS_GEMM", False)


def rows_gemm_ok(x: torch.Tensor, weight: torch.Tensor, fused: bool) -> bool:
    """Whether the few-row GEMM takes this call (ONECAT_ROWS_GEMM=1, fused kernels on, CUDA, 2-32 rows of
    fp16/bf16)."""
    if not (fused and ROWS_GEMM and x.is_cuda):
        return False
    from onecat.engine.kernels.triton_rows_gemm import rows_gemm_unsupported_reason

    return rows_gemm_unsupported_reason(x, weight) is None


def project(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, fused: bool,
            owner: nn.Module | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias), through the rows GEMV or the few-row GEMM where one takes the call (a weight no
    Linear holds: a drafter's stacked q/k/v); float32 on CPU through the batch-invariant matmul, the packed weight
    kept on `owner`."""
    if fused and dense_rows.takes(x, weight):
        return dense_rows.dense_rows_gemv(x, weight, bias)
    if rows_gemm_ok(x, weight, fused):
        from onecat.engine.kernels.triton_rows_gemm import rows_gemm

        return rows_gemm(x, weight, bias)
    if owner is not None and batch_invariant_linear.supported(x, weight):
        return batch_invariant_linear.invariant_matmul(owner, weight, bias, x)
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    use_fused = False  # the engine turns this on per model (CUDA + Triton)

    def gemv_ok(self, x: torch.Tensor) -> bool:
        if not (self.use_fused and x.is_cuda and 0 < x.numel() <= gemv_row_limit() * x.shape[-1]):
            return False
        from onecat.engine.kernels.triton_gemv import gemv_unsupported_reason

        return gemv_unsupported_reason(x, self.weight) is None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not x.is_cuda:  # a CPU step: its float32 rows first, with no CUDA path's checks and one parameter lookup
            params = self._parameters
            weight = params["weight"]
            if batch_invariant_linear.supported(x, weight):
                return batch_invariant_linear.invariant_matmul(self, weight, params["bias"], x)
        if self.gemv_ok(x):
            from onecat.engine.kernels.triton_gemv import gemv

            return gemv(x, self.weight, self.bias)
        if self.use_fused and dense_rows.takes(x, self.weight):
            return dense_rows.dense_rows_gemv(x, self.weight, self.bias)
        if rows_gemm_ok(x, self.weight, self.use_fused):
            from onecat.engine.kernels.triton_rows_gemm import rows_gemm

            return rows_gemm(x, self.weight, self.bias)
        if self.weight.is_meta:  # F.linear would return uninitialized memory
            raise RuntimeError(f"this layer keeps only its oneDNN-packed float32 weight; it cannot take a "
                               f"{x.dtype} input on {x.device}")
        return F.linear(x, self.weight, self.bias)


def norm_then_linear(norm, linear: nn.Module, x: torch.Tensor, residual: torch.Tensor, silu_mul=None):
    """(linear(norm(x + residual)), x + residual) for an RMSNorm `norm`. With `silu_mul` (the unfused
    activation), `linear` is a fused [gate | up] projection and the first item is SiLU(gate) * up."""
    if isinstance(linear, Linear) and linear.gemv_ok(x):
        from onecat.engine.kernels.triton_gemv import gemv

        return gemv(x, linear.weight, linear.bias, residual=residual, norm_weight=norm.weight, eps=norm.eps,
                    glu=silu_mul is not None)
    folded = getattr(linear, "fused_norm_gemv", None)  # a packed layer (engine/quant/*_linear.py)
    if folded is not None and residual is not None:
        out = folded(x, residual, norm, silu_mul is not None)
        if out is not None:
            return out
    fused = norm.cpu_fused(x, residual, bf16_out=getattr(linear, "input_dtype", None) == torch.bfloat16)
    x, residual = fused if fused is not None else norm(x, residual)
    if silu_mul is not None:
        act = glu_in_gemv(linear, x, getattr(norm, "use_fused", False))
        if act is not None:
            return act, residual
    y = linear(x)
    return (y if silu_mul is None else silu_mul(y)), residual


def glu_in_gemv(linear: nn.Module, x: torch.Tensor, fused: bool) -> torch.Tensor | None:
    """SiLU(gate) * up of a [gate | up] layer's output, computed in its matmul: a packed layer's GEMV
    (engine/quant/tiled_words.py glu_gemv: one kernel fewer a decode step, the same bits) or a dense layer's
    rows GEMV or few-row GEMM; None: fused ops off, or a layer or call those kernels do not take. A packed CPU
    layer whose step has prompt rows on AMX tiles computes it in their epilogue whatever `fused` says (the same
    bits as the unfused activation: engine/quant/int4/linear.py glu_prompt_rows)."""
    prompt_glu = getattr(linear, "glu_prompt_rows", None)
    act = prompt_glu(x) if prompt_glu is not None else None
    if act is not None:
        return act
    if (isinstance(linear, Linear) and fused and linear.use_fused and linear.bias is None
            and dense_rows.takes(x, linear.weight, glu=True)):
        return dense_rows.dense_rows_gemv(x, linear.weight, glu=True)
    if isinstance(linear, Linear) and rows_gemm_ok(x, linear.weight, fused and linear.use_fused):
        from onecat.engine.kernels.triton_rows_gemm import rows_gemm

        return rows_gemm(x, linear.weight, linear.bias, glu=True)
    glu = getattr(linear, "glu_gemv", None) if fused else None
    return None if glu is None else glu(x)


def pack_weights(model: nn.Module) -> None:
    """Reorder the float32 CPU weights of model's Linear layers for the batch-invariant matmul now. A
    weight that another module also uses (a tied embedding does) keeps its dense copy."""
    shared = {id(p) for m in model.modules() if not isinstance(m, Linear) for p in m.parameters(recurse=False)}
    for m in model.modules():
        if isinstance(m, Linear) and m.weight.device.type == "cpu" and m.weight.dtype == torch.float32:
            batch_invariant_linear.pack_weight(m, keep_dense=id(m.weight) in shared)
