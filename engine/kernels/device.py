"""What the kernel choices read of a CUDA device, asked once per device (no Triton, no extension build)."""
from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=None)
def capability(device_index: int) -> int:
    """The device's compute capability as one number, 10 * major + minor (e.g. 90 on an H200, 70 on a V100)."""
    major, minor = torch.cuda.get_device_capability(device_index)
    return 10 * major + minor
