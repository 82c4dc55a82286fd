"""Gated DeltaNet on CUDA through flash-linear-attention (the `fla-core` package: Triton kernels, an optional
dependency, `pip install onecat[cuda-hybrid]`): the chunked form for prefill chunks and the fused recurrent
form for a batch of one-token steps. The torch reference (engine/layers/gated_deltanet_ops.py) stays the path
on CPU and wherever fla is missing.

Both take q and k as projected (fla l2-normalizes them in the kernel, eps 1e-6 as the reference, and scales q
by Dk^-1/2) with the key heads not repeated: value head j reads key head j // (Hv / Hk), the reference's
repeat_interleave. The state is float32 [Hv, Dk, Dv], the layout of the engine's state cache.
"""
from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=1)
def _import_reason() -> str | None:
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule  # noqa: F401
    except Exception as e:  # not installed, or no usable Triton
        return f"flash-linear-attention is not importable ({type(e).__name__}: {e}); pip install fla-core"
    return None


def unavailable_reason(x: torch.Tensor) -> str | None:
    """Why fla cannot run the gated delta rule on x (None: it can)."""
    if x.device.type != "cuda":
        return f"input is on {x.device}, not a CUDA device"
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"dtype {x.dtype} unsupported"
    return _import_reason()


def chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
          state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One request's chunk: q, k [n, Hk, Dk]; v [n, Hv, Dv]; g (log decay), beta [n, Hv]; state [Hv, Dk, Dv]
    float32 -> (outputs [n, Hv, Dv] float32, the state after the chunk)."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    o, s = chunk_gated_delta_rule(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), g.float().unsqueeze(0),
                                  beta.to(v.dtype).unsqueeze(0), scale=q.shape[-1] ** -0.5,
                                  initial_state=state.unsqueeze(0).float(), output_final_state=True,
                                  use_qk_l2norm_in_kernel=True)
    return o[0].float(), s[0]


def recurrent_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of one-token steps: q, k [B, Hk, Dk]; v [B, Hv, Dv]; g, beta [B, Hv]; states [B, Hv, Dk, Dv]
    float32 -> (outputs [B, Hv, Dv] float32, the new states)."""
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

    o, s = fused_recurrent_gated_delta_rule(q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1), g.float().unsqueeze(1),
                                            beta=beta.to(v.dtype).unsqueeze(1), scale=q.shape[-1] ** -0.5,
                                            initial_state=states.float(), output_final_state=True,
                                            use_qk_l2norm_in_kernel=True)
    return o[:, 0].float(), s
