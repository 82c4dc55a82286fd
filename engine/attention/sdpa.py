"""`scaled_dot_product_attention` for variable-length work, kept off cuDNN's attention on CUDA.

torch picks cuDNN's fused attention on recent GPUs (H100/H200) when it can. cuDNN builds an execution
plan for every new sequence length: measured on an H200 with a 30-layer model, a prompt length not
seen before cost about 1 s on its first use and then 1.4 ms per layer call (60 ms per request against
14 ms for a length seen before), so real traffic with varied prompt lengths paid it on most requests.
The flash and memory-efficient kernels take lengths as runtime values; the math kernel is the last
resort. On CPU the call is left as it is.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

try:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    _SHAPE_FREE = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
except ImportError:  # torch < 2.3: no cuDNN attention to avoid
    sdpa_kernel = None


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs) -> torch.Tensor:
    """F.scaled_dot_product_attention(q, k, v, **kwargs), never through cuDNN attention."""
    if q.device.type != "cuda" or sdpa_kernel is None:
        return F.scaled_dot_product_attention(q, k, v, **kwargs)
    with sdpa_kernel(_SHAPE_FREE):
        return F.scaled_dot_product_attention(q, k, v, **kwargs)
