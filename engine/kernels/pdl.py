"""Programmatic dependent launch (SM90+) for the decode step's Triton kernels.

A batch-1 decode step is some 500 small kernels in a row, and each one pays its launch, its first DRAM
round trip and the tail of the kernel before it. Launched with PDL, a kernel's programs may start while
the previous kernel is still finishing: they run up to `griddepcontrol.wait` (which returns once the
previous kernel has completed and its writes are visible), then `griddepcontrol.launch_dependents` lets
the next kernel start in turn. Every kernel launched this way keeps the same rule:

  before the wait  only loads of memory no earlier kernel of the step writes (weights), and no stores;
  after the wait   everything else, then the trigger for the next kernel.

Since a kernel triggers only after its own wait, every kernel two or more back has completed when a
kernel starts. The arithmetic is unchanged: results are bit-identical with PDL on or off.
Off on SM70-SM89 (no griddepcontrol), in Triton's interpreter, and with a Triton that lacks it.
"""
from __future__ import annotations

import functools
import os

import torch

ENABLED = True  # the switch benchmarks flip to measure the same kernels without PDL


@functools.lru_cache(maxsize=None)
def _supported(device_index: int) -> bool:
    if os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.get_device_capability(device_index)[0] < 9:
        return False
    try:
        from triton.language.extra import cuda as tl_cuda
    except Exception:  # an older Triton or none
        return False
    return hasattr(tl_cuda, "gdc_wait") and hasattr(tl_cuda, "gdc_launch_dependents")


def options(device: torch.device) -> dict:
    """Keyword arguments for a Triton launch of a kernel with a `PDL: tl.constexpr` parameter on `device`."""
    if ENABLED and device.type == "cuda" and _supported(device.index if device.index is not None
                                                        else torch.cuda.current_device()):
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}
