"""Small host values onto the device without making the host wait for the device.

`torch.tensor(values, device=cuda)` copies synchronously: the host waits until every kernel queued before
the copy has run, so it can never prepare the next launches while the device works (a decode step or a
speculative round then pays its host time on top of its device time). A copy with `non_blocking=True`
from pageable memory returns once the driver has staged the values: the device reads them in stream
order, the host goes on.
"""
from __future__ import annotations

import torch


def to_device(values, device: torch.device | str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`values` (numbers, nested lists, a range) as a tensor of `dtype` on `device`, queued, not waited for."""
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)
