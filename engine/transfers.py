"""Small host values onto the device without making the host wait for the device.

`torch.tensor(values, device=cuda)` copies synchronously: the host waits until every kernel queued before
the copy has run, so it can never prepare the next launches while the device works (a decode step or a
speculative round then pays its host time on top of its device time). Here the values go through pinned
(page-locked) host memory with `non_blocking=True`: the copy is queued in stream order and the host goes on;
torch's pinned-memory allocator keeps the buffer until the copy has run.
"""
from __future__ import annotations

import torch


def to_device(values, device: torch.device | str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`values` (numbers, nested lists, a range) as a tensor of `dtype` on `device`, queued, not waited for."""
    host = torch.tensor(values, dtype=dtype)
    if torch.device(device).type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
