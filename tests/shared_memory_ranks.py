"""One CPU rank of tests/test_tensor_parallel.py's shared-memory collectives test, in a module that imports only
torch and the collectives: each spawned rank imports this, not the test module (the engine, the embedded model)."""
from __future__ import annotations

import time


def shm_rank(rank: int, world: int, name: str, ready, out) -> None:
    import torch

    from onecat.engine.parallel.collectives import SharedMemoryRanks

    if rank != 0:
        ready.wait()
    shm = SharedMemoryRanks(name, rank, world, create=rank == 0)
    if rank == 0:
        ready.set()
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(5, 7, generator=g)
    results = []
    for step in range(3):  # both buffers, and one reused
        y = x * (step + 1)
        shm.all_reduce(y)
        pieces = [torch.empty(2, 3) for _ in range(world)]
        shm.all_gather(pieces, torch.full((2, 3), float(rank + step)))
        results.append((y, pieces))
    out.put((rank, results))
    time.sleep(0.5)  # every rank read the last exchange before the owner unlinks
    shm.close()
