"""The sums and gathers of the tensor-parallel layers, and a shared-memory path for CPU ranks.

gloo, torch's CPU backend, moves even one hidden row over loopback TCP: ~1.5 ms per all-reduce on a
2-core host (benchmarks/results/tp_cpu.json), and a decoder step has two per layer. CPU ranks of one
host instead meet in one shared-memory segment: each rank writes its part into its slot, waits until
every rank has written (a counter per rank), then reads all slots and sums them in rank order, so
every rank ends with the same bits. Slots are double-buffered by call parity: a rank can be at most
one call ahead of the slowest (it cannot pass the next barrier alone), so it never overwrites a slot
another rank is still reading (x86 only: its stores are seen in order, so a counter is never seen
before the data it publishes; elsewhere gloo is used). GPU ranks that can map each other's memory
meet the same way in GPU memory (peer_collectives.py). A tensor larger than a slot goes through
torch.distributed (NCCL / gloo) on the default group; the choice depends only on the shape, which is
the same on every rank, so all ranks always take the same path.
"""
from __future__ import annotations

import os
import platform
import sys
import time
from multiprocessing import resource_tracker, shared_memory

import torch
import torch.distributed as dist

SLOT_BYTES = 8 << 20  # per rank and buffer: decode steps (hidden rows, logits slices of a few rows) fit
WAIT_TIMEOUT_S = 120  # a rank that never arrives (it died) fails the collective instead of hanging it
_FLAG_STRIDE = 8  # int64 counters one 64-byte cache line apart


def shm_name(port: int) -> str:
    """The segment of the ranks that met at rendezvous `port` (one per engine on this host)."""
    return f"onecat_tp_{port}"


def shared_memory_usable() -> bool:
    """The counters are plain stores published after the data: ordered on x86's memory model only."""
    return platform.machine().lower() in ("x86_64", "amd64")


class SharedMemoryRanks:
    """One segment: per rank a counter, and two slots of SLOT_BYTES (call parity)."""

    def __init__(self, name: str, rank: int, world: int, create: bool, tracked: bool = True):
        """`tracked=False` (a rank that opens the segment in a process multiprocessing did not start): this
        process's own resource tracker must not claim it, or it would unlink it and warn of a leak when
        this process exits; the creating rank's tracker and close() own it."""
        self.rank, self.world = rank, world
        header = world * _FLAG_STRIDE * 8
        size = header + 2 * world * SLOT_BYTES
        if create or tracked:
            self.shm = shared_memory.SharedMemory(name=name, create=create, size=size)
        elif sys.version_info >= (3, 13):
            self.shm = shared_memory.SharedMemory(name=name, size=size, track=False)
        else:  # attaching registers it with this process's tracker before 3.13: take that back
            self.shm = shared_memory.SharedMemory(name=name, size=size)
            resource_tracker.unregister(self.shm._name, "shared_memory")
        self.owner = create  # the creating rank unlinks it
        self.flags = torch.frombuffer(self.shm.buf, dtype=torch.int64, count=world * _FLAG_STRIDE)
        if create:
            self.flags.zero_()
        self.arrived = self.flags[::_FLAG_STRIDE]
        self.slots = [[torch.frombuffer(self.shm.buf, dtype=torch.uint8, count=SLOT_BYTES,
                                        offset=header + (parity * world + r) * SLOT_BYTES) for r in range(world)]
                      for parity in range(2)]
        self.calls = 0
        self.peers_gone = lambda: None  # a reason when a rank this one waits on is known dead (set by the owner)

    def fits(self, nbytes: int) -> bool:
        return nbytes <= SLOT_BYTES

    def _exchange(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Publish t, wait for every rank's, and return views of all ranks' tensors (rank order)."""
        self.calls += 1
        slots = self.slots[self.calls % 2]
        nbytes = t.numel() * t.element_size()
        views = [s[:nbytes].view(t.dtype).view(t.shape) for s in slots]
        views[self.rank].copy_(t)
        self.arrived[self.rank] = self.calls
        start = check = None
        while bool((self.arrived < self.calls).any()):
            os.sched_yield()  # more ranks than cores must not starve the ones still computing
            now = time.monotonic()
            if start is None:
                start = check = now
            elif now - check > 0.5:
                check = now
                gone = self.peers_gone()
                late = [r for r in range(self.world) if int(self.arrived[r]) < self.calls]
                if gone or now - start > WAIT_TIMEOUT_S:
                    raise RuntimeError(f"tensor-parallel ranks {late} did not reach collective {self.calls}: "
                                       f"{gone or f'nothing from them in {WAIT_TIMEOUT_S} s'}")
        return views

    def all_reduce(self, t: torch.Tensor) -> None:
        views = self._exchange(t.contiguous())
        t.copy_(views[0])
        for v in views[1:]:
            t.add_(v)

    def all_gather(self, pieces: list[torch.Tensor], t: torch.Tensor) -> None:
        for piece, v in zip(pieces, self._exchange(t.contiguous())):
            piece.copy_(v)

    def close(self) -> None:
        """Unlink first (the owner): the name must go even if a tensor still views the mapping, which
        then lives until that tensor does."""
        self.flags = self.arrived = self.slots = None
        if self.owner:
            self.shm.unlink()
            self.owner = False
        try:
            self.shm.close()
        except BufferError:  # a view of the mapping is still alive somewhere; the OS unmaps it at exit
            pass


class Collectives:
    """What the sharded layers call: shared memory once attached (CPU ranks), the one-shot kernel over
    peer-mapped buffers for small GPU tensors once set up (peer_collectives.py), else torch.distributed
    (NCCL / gloo)."""

    def __init__(self) -> None:
        self.shm: SharedMemoryRanks | None = None
        self.peer = None  # PeerBuffers on GPU ranks that can map each other's memory

    def _shared(self, t: torch.Tensor) -> bool:
        """Whether t goes through shared memory (decided by device and size alone: the same on every rank)."""
        return self.shm is not None and not t.is_cuda and self.shm.fits(t.numel() * t.element_size())

    def all_reduce(self, t: torch.Tensor) -> None:
        if self.peer is not None and self.peer.fits(t):
            self.peer.all_reduce(t)
        elif self._shared(t):
            self.shm.all_reduce(t)
        else:
            dist.all_reduce(t)

    def all_gather(self, pieces: list[torch.Tensor], t: torch.Tensor) -> None:
        if self.peer is not None and self.peer.fits(t):
            for piece, gathered in zip(pieces, self.peer.all_gather(t)):
                piece.copy_(gathered)
        elif self._shared(t):
            self.shm.all_gather(pieces, t)
        else:
            dist.all_gather(pieces, t)

    def after_step(self) -> None:
        """Rank 0, after launching a step: queue the read-back of the GPU collectives' timeout mark."""
        if self.peer is not None:
            self.peer.note_step()

    def failure(self) -> str | None:
        """Why an earlier step's results cannot be trusted (a GPU collective gave up on a rank), or None."""
        if self.peer is not None and self.peer.timed_out_seen():
            return ("a GPU all-reduce waited more than its timeout for another rank (it died or stopped "
                    "stepping); that step's sums are wrong")
        return None

    def close(self) -> None:
        if self.shm is not None:
            self.shm.close()
            self.shm = None
        if self.peer is not None:
            self.peer.close()
            self.peer = None
