"""Fused kernels for the per-layer small ops (norms, activations, residual adds): Triton on CUDA, the C++
CPU ops (float32) on CPU; where they cannot run, the reference torch ops, with the reason reported."""
from __future__ import annotations

import torch


def enable_fused_kernels(model: torch.nn.Module, device: torch.device, dtype: torch.dtype, wanted: bool) -> dict:
    """Switch `model`'s layers to the fused kernels where they can run; returns what was chosen and why
    (LLM.info()'s `fused_kernels_detail`)."""
    if device.type == "cuda":
        from onecat.engine.kernels.triton_support import fused_unavailable_reason

        reason = "turned off (fused_kernels=False)" if not wanted else fused_unavailable_reason()
        from onecat.engine.layers import gated_deltanet, hybrid_kernels

        for m in model.modules():
            if hasattr(type(m), "use_fused"):
                m.use_fused = reason is None
        report = {"used": reason is None, "kind": "triton", "reason": reason}
        if any(isinstance(m, gated_deltanet.GatedDeltaNet) for m in model.modules()):
            report["hybrid"] = hybrid_kernels.describe(reason is None)
        return report
    from onecat.engine.kernels import cpu_ops

    reason = ("turned off (fused_kernels=False)" if not wanted else
              f"the CPU fused ops take float32 models; dtype {dtype} runs the torch ops"
              if dtype != torch.float32 else cpu_ops.unavailable_reason())
    ops = cpu_ops.load() if reason is None else None
    for m in model.modules():
        if hasattr(type(m), "cpu_ops"):
            m.cpu_ops = ops
        # the fused ops after o_proj, gate_up and down_proj read a packed matmul's bf16 output directly
        for name in ("o_proj", "gate_up_proj", "down_proj"):
            if hasattr(getattr(m, name, None), "keep_kernel_output"):
                getattr(m, name).keep_kernel_output = reason is None
    report = {"used": reason is None, "kind": "cpu", "reason": reason}
    if reason is None and hasattr(type(model), "cpu_decode"):
        from onecat.engine.models import llama_cpu_decode

        why_not = llama_cpu_decode.unsupported_reason(model)
        model.cpu_decode = llama_cpu_decode.CpuDecodeLayers(model, ops) if why_not is None else None
        steps = "decode steps" if why_not is None and model.cpu_decode.int8 else "batch-1 decode steps"
        report["one_call_decode"] = why_not or f"{steps} run all layers in one C++ call"
    return report
