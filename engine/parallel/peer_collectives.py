"""One-shot all-reduce and all-gather over peer-mapped GPU buffers, for the small tensors of decode steps.

NCCL's all-reduce of one hidden row costs ~31 us eager and ~16 us inside a CUDA graph on two NVLinked
H200s, and a decoder step has two per layer: a millisecond per step against ~2 ms of weight streaming
for an 8B model at TP=2. Here each rank owns one buffer that every other rank has mapped (CUDA IPC,
through torch's own CUDA tensor sharing). One kernel per collective: every block copies its chunk of the
input into the rank's buffer, raises its flag in every rank's buffer (release, system scope), waits
until every rank's matching block has raised its flag (acquire), then reads that chunk from all ranks
over NVLink and sums it in rank order in float32, so every rank ends with the same bits (an all-gather
copies the chunks instead). The pointer table and the per-block call counters live in device memory,
so the kernel replays inside CUDA graphs unchanged.

Reuse: data alternate between two halves of the buffer by call parity. A block can be at most one call
ahead of the same block on another rank (it cannot pass the next flag wait alone), and a rank's next
kernel starts only after its previous one finished, so a half is never overwritten while a peer still
reads it. The grid is fixed, so every block runs in every call and the per-block counters stay equal.

A rank that never arrives (it died) is not waited on forever: a block gives up after WAIT_TIMEOUT_S by
the GPU's global timer, marks `timed_out` and lets the step finish with a wrong sum; the engine reads the
mark after the step (a pinned copy, no extra sync) and fails with an error.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

NUM_BLOCKS = 32  # CTAs per call: every one joins every call (fixed grid, equal call counters)
MAX_WORLD = 8
BLOCK = 1024  # elements per CTA iteration
HEADER_BYTES = 4096  # flags: int32 [NUM_BLOCKS, MAX_WORLD]
# per parity half: the largest tensor (or gathered piece) this path takes. One-shot reads every peer's whole
# tensor with ~2 KB per block in flight, so past a few hundred KB NCCL's ring should win; where exactly was
# not measured (no two-GPU host), 512 KiB is an estimate from NVLink latency (~2 us per round trip).
CAPACITY_BYTES = 512 << 10
WAIT_TIMEOUT_S = 30


@triton.jit
def _now_ns():
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False,
                                     pack=1)

@triton.jit
def peer_collective(inp, out, n, bases, epochs, timed_out, RANK: tl.constexpr, WORLD: tl.constexpr,
                    GATHER: tl.constexpr, HEADER: tl.constexpr, CAP: tl.constexpr, MAXW: tl.constexpr,
                    BLOCK: tl.constexpr, TIMEOUT_NS: tl.constexpr):
    pid = tl.program_id(0)
    dtype = inp.dtype.element_ty
    e = tl.load(epochs + pid) + 1
    half = (e % 2).to(tl.int64) * CAP + HEADER
    chunk = tl.cdiv(tl.cdiv(n, tl.num_programs(0)), BLOCK) * BLOCK
    start = pid * chunk
    end = tl.minimum(start + chunk, n)
    own = tl.load(bases + RANK)
    mine = tl.multiple_of((own + half).to(tl.pointer_type(dtype)), 16)  # buffers are 16-byte aligned
    for off in range(start, end, BLOCK):
        idx = off + tl.arange(0, BLOCK)
        m = idx < end
        tl.store(mine + idx, tl.load(inp + idx, mask=m), mask=m)
    tl.debug_barrier()  # the whole chunk is written before the flag says so
    for r in tl.static_range(WORLD):
        flag = (tl.load(bases + r) + (pid * MAXW + RANK) * 4).to(tl.pointer_type(tl.int32))
        tl.atomic_xchg(flag, e, sem="release", scope="sys")
    t0 = _now_ns()
    for r in tl.static_range(WORLD):
        flag = (own + (pid * MAXW + r) * 4).to(tl.pointer_type(tl.int32))
        seen = tl.atomic_add(flag, 0, sem="acquire", scope="sys")
        waited = t0 - t0  # int64, as the loop makes it
        while (seen < e) & (waited < TIMEOUT_NS):
            seen = tl.atomic_add(flag, 0, sem="acquire", scope="sys")
            waited = _now_ns() - t0
        if seen < e:
            tl.store(timed_out, 1)
    tl.debug_barrier()
    for off in range(start, end, BLOCK):
        idx = off + tl.arange(0, BLOCK)
        m = idx < end
        if GATHER:
            for r in tl.static_range(WORLD):
                src = tl.multiple_of((tl.load(bases + r) + half).to(tl.pointer_type(dtype)), 16)
                tl.store(out + r * n + idx, tl.load(src + idx, mask=m, cache_modifier=".cv"), mask=m)
        else:
            acc = tl.zeros([BLOCK], dtype=tl.float32)
            for r in tl.static_range(WORLD):  # rank order: the same sum, bit for bit, on every rank
                src = tl.multiple_of((tl.load(bases + r) + half).to(tl.pointer_type(dtype)), 16)
                acc += tl.load(src + idx, mask=m, other=0.0, cache_modifier=".cv").to(tl.float32)
            tl.store(out + idx, acc.to(dtype), mask=m)
    tl.store(epochs + pid, e)


def _share(t: torch.Tensor) -> tuple:
    """What another process needs to map t's memory: torch's own CUDA IPC export of its storage
    (plain picklable values: device, IPC handle, sizes, the reference counter and event handles)."""
    return t.untyped_storage()._share_cuda_()


def _open(shared: tuple, device: torch.device) -> torch.UntypedStorage:
    """Map a peer's exported storage on this rank's own device (the handle's own device is replaced):
    the driver enables peer access lazily, and no context is made on the peer's GPU."""
    _, *rest = shared
    return torch.UntypedStorage._new_shared_cuda(device.index, *rest)


class PeerBuffers:
    """This rank's mapped buffer and its peers', and the two collectives over them."""

    DTYPES = (torch.float16, torch.bfloat16, torch.float32)
    capacity_bytes = CAPACITY_BYTES

    def __init__(self, rank: int, world: int, device: torch.device, exchange):
        """`exchange(obj) -> [obj of every rank]` is an all-gather of picklable objects among the ranks
        (torch.distributed.all_gather_object on the ranks' group)."""
        if not 2 <= world <= MAX_WORLD:
            raise ValueError(f"peer collectives run 2..{MAX_WORLD} ranks, not {world}")
        self.rank, self.world, self.device = rank, world, device
        self.buffer = torch.zeros(HEADER_BYTES + 2 * CAPACITY_BYTES, dtype=torch.uint8, device=device)
        torch.cuda.synchronize(device)  # zeroed flags are visible before any peer maps them
        handles = exchange((rank, _share(self.buffer)))
        self.peers = {}
        for r, shared in handles:
            if r != rank:
                self.peers[r] = _open(shared, device)  # keeps the mapping alive
        bases = [self.buffer.data_ptr() if r == rank else self.peers[r].data_ptr() for r in range(world)]
        self.bases = torch.tensor(bases, dtype=torch.int64, device=device)
        self.epochs = torch.zeros(NUM_BLOCKS, dtype=torch.int32, device=device)
        self.timed_out = torch.zeros(1, dtype=torch.int32, device=device)
        self._timed_out_host = torch.zeros(1, dtype=torch.int32, pin_memory=True)
        exchange(None)  # every rank has mapped every buffer before any kernel runs

    @classmethod
    def over_group(cls, rank: int, world: int, device: torch.device) -> "PeerBuffers":
        """Set up on every rank of the default torch.distributed group (a collective: all ranks call it)."""
        import torch.distributed as dist

        def exchange(obj):
            got = [None] * world
            dist.all_gather_object(got, obj)
            return got

        return cls(rank, world, device, exchange)

    def fits(self, t: torch.Tensor) -> bool:
        """Whether t takes this path: decided by shape and dtype alone, the same on every rank."""
        return t.is_cuda and t.dtype in self.DTYPES and 0 < t.numel() * t.element_size() <= CAPACITY_BYTES

    def _launch(self, inp: torch.Tensor, out: torch.Tensor, gather: bool) -> None:
        peer_collective[(NUM_BLOCKS,)](
            inp, out, inp.numel(), self.bases, self.epochs, self.timed_out, RANK=self.rank, WORLD=self.world,
            GATHER=gather, HEADER=HEADER_BYTES, CAP=CAPACITY_BYTES, MAXW=MAX_WORLD, BLOCK=BLOCK,
            TIMEOUT_NS=WAIT_TIMEOUT_S * 1_000_000_000, num_warps=4)

    def all_reduce(self, t: torch.Tensor) -> None:
        """Sum t over the ranks, in place."""
        inp = t.contiguous()
        out = inp if inp.data_ptr() == t.data_ptr() else torch.empty_like(inp)
        self._launch(inp, out, gather=False)
        if out.data_ptr() != t.data_ptr():
            t.copy_(out)

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """[world, *t.shape]: every rank's t, in rank order."""
        inp = t.contiguous()
        out = torch.empty((self.world, *inp.shape), dtype=inp.dtype, device=inp.device)
        self._launch(inp, out, gather=True)
        return out

    def note_step(self) -> None:
        """Queue a copy of the timeout mark after the step's kernels (read by `timed_out_seen`)."""
        self._timed_out_host.copy_(self.timed_out, non_blocking=True)

    def timed_out_seen(self) -> bool:
        """Whether a collective before the last `note_step` gave up waiting on a rank (valid once the
        stream has passed that copy: rank 0 has read the step's logits by then)."""
        return bool(self._timed_out_host.item())

    def close(self) -> None:
        self.peers.clear()
