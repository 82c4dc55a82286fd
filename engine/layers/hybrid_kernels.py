"""The A/B switch of Qwen3.5's fused CUDA kernels: the zero-centered add + RMSNorm (triton_fused.py), the ops
around the gated attention (triton_gated_attention.py) and the Gated DeltaNet step between its projections
(triton_gated_delta_step.py). Each replaces tens of small torch kernels a layer; they run where fused kernels
are on (an H100 A/B: route 1 target-only 112.5 against 58.6 tok/s, the same tokens; docs/models.md), unless
ONECAT_FUSED_HYBRID=0. Read once: benchmarks set it per process for their arms; tests set ENABLED."""
from __future__ import annotations

from onecat.engine.switches import switch

ENABLED = switch("ONECAT_FUSED_HYBRID", True)


def describe(fused_kernels: bool) -> str:
    """What a CUDA step of a hybrid model runs around its projections (LLM.info()'s fused_kernels_detail)."""
    if fused_kernels and ENABLED:  # fused kernels usable: Triton is there
        from onecat.engine.kernels import triton_gated_delta_verify as split

        verify = "split in three kernels" if split.SPLIT_VERIFY else "the step kernel walking the rows"
        return ("fused: zero-centered norms, gated attention's q/k norm + RoPE + cache write and sigmoid gate, "
                f"DeltaNet decode and graph verify steps (verify rows: {verify}; ONECAT_FUSED_HYBRID=0 turns them off)")
    return ("torch ops around the projections and recurrent kernels" +
            ("" if fused_kernels else " (fused kernels are off)") + ("" if ENABLED else " (ONECAT_FUSED_HYBRID=0)"))
