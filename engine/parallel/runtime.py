"""Tensor-parallel ranks of one engine on one host: one process per rank.

Rank 0 is the process that built the `LLM`: it owns the scheduler, the sampler, stop logic, speculative
drafting and the API. Ranks 1..N-1 are worker processes started here from onecat's own entry module
(rank_process.py: nothing of the user's main module is re-imported); each builds a
`Worker` (engine/worker/worker.py) of the same model, which keeps its shard (engine/parallel/sharding.py)
and a KV cache of its own KV heads with rank 0's block count, then runs the model on every step rank 0
sends it. A step's metadata (token ids,
positions, slots, block tables, the rows that need logits: `StepInputs`, a few plain lists) goes over a
pipe per worker; activations meet in the layers' collectives over the process group (NCCL on GPUs,
gloo on CPU). Every rank then holds the full logits; only rank 0 reads them.

Failure: a worker that raises sends its traceback and exits; a worker that dies while starting is seen
within START_POLL_S (rank 0 polls the workers while it waits for them at the rendezvous, instead of one
blocking wait), with its exit and last stderr lines; a worker that dies later is seen before the
next step is sent (and by a shared-memory collective waiting on it within 0.5 s; gloo/NCCL get
`COLLECTIVE_TIMEOUT_S`); either way rank 0 raises `TensorParallelError` with the worker's own message,
and `close()` leaves no process.
Rank 0 dying closes the pipes, and every worker exits on the closed pipe.
"""
from __future__ import annotations

import os
import socket
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import wait as wait_for_connections

import torch
import torch.distributed as dist

from onecat.engine.errors import EngineError
from onecat.engine.parallel.rank_process import RankProcess
from onecat.engine.switches import switch

COLLECTIVE_TIMEOUT_S = 120  # a collective waiting longer than this on a rank fails instead of hanging
START_TIMEOUT_S = 600  # a worker that has not reached the rendezvous, or built its shard, by then is treated as dead
START_POLL_S = 0.1  # how often rank 0 looks at its starting workers
ARRIVED_KEY = "onecat_tp_ranks_arrived"  # the rendezvous store's count of workers about to join the group


class TensorParallelError(EngineError):
    """A tensor-parallel rank failed or died; the engine cannot step any more."""


@dataclass(frozen=True)
class RankInfo:
    rank: int
    world: int
    port: int  # rendezvous port on 127.0.0.1


_worker_rank: RankInfo | None = None  # set in a worker process before it builds its Worker


def worker_rank() -> RankInfo | None:
    """This process's rank when it is a tensor-parallel worker (None in the user's process)."""
    return _worker_rank


# Testing only: every rank on the first GPU, for checking the GPU paths of tensor parallelism (graphs with
# collectives inside, the peer-buffer kernel) on a one-GPU host. NCCL refuses two ranks on one GPU, so
# the group is gloo; collectives inside CUDA graphs must then all take the peer-buffer path. Slow (the
# ranks' kernels time-share one GPU) and never a way to run a model.
SHARE_DEVICE_ENV = "ONECAT_TP_SHARE_DEVICE"


def ranks_share_device() -> bool:
    return bool(switch(SHARE_DEVICE_ENV, False))


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" and not ranks_share_device() else "gloo"


def init_group(info: RankInfo, device: torch.device, store: dist.TCPStore | None = None,
               check_ranks=None) -> None:
    """Join the ranks' process group (rendezvous on a TCP store on this host); `device` is this rank's.
    Rank 0 may pass the store it made and `check_ranks` (raises when a worker died): it then waits until
    every worker has arrived at the store before joining, calling `check_ranks` every START_POLL_S, so a
    worker that died before the rendezvous fails start-up at once instead of after the store's timeout."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    if store is None:
        store = dist.TCPStore("127.0.0.1", info.port, info.world, is_master=info.rank == 0, timeout=timeout,
                              wait_for_workers=False)
    if info.rank != 0:
        store.add(ARRIVED_KEY, 1)
    elif check_ranks is not None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while store.add(ARRIVED_KEY, 0) < info.world - 1:
            check_ranks()
            if time.monotonic() > deadline:
                raise TimeoutError(f"the worker ranks did not reach the rendezvous in {START_TIMEOUT_S} s")
            time.sleep(START_POLL_S)
    dist.init_process_group(backend_for(device), store=store, rank=info.rank, world_size=info.world,
                            timeout=timeout)


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank r's device: GPU r of the host (after the first one the user chose), the CPU for every CPU rank."""
    if device.type != "cuda":
        return device
    first = device.index or 0
    return torch.device("cuda", first if ranks_share_device() else first + rank)


def threads_per_rank(world: int) -> int:
    """CPU ranks share the cores the process may use: each takes its share (at least one)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // world)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_rank(conn) -> None:
    """A worker rank (rank_process.py): take (RankInfo, the Worker class, EngineArgs) from rank 0, build the
    shard (the Worker sees worker_rank() set), say ready, run steps until told to stop or the pipe closes."""
    global _worker_rank
    rank = "?"
    try:
        _start, (info, worker_cls, args) = conn.recv()
        rank = info.rank
        _worker_rank = info
        torch.set_num_threads(threads_per_rank(info.world))
        worker = worker_cls(args)  # joins the group, builds and shards the model
        conn.send(("ready", None))
        while True:
            try:
                kind, payload = conn.recv()
            except EOFError:  # rank 0 is gone
                break
            if kind == "stop":
                break
            worker.run_remote(kind, payload)
    except BaseException as e:  # noqa: BLE001 - every failure goes back to rank 0 as text
        try:
            conn.send(("error", f"rank {rank}: {type(e).__name__}: {e}\n{traceback.format_exc()}"))
        except (BrokenPipeError, OSError):
            pass
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


class WorkerRanks:
    """Rank 0's handle on ranks 1..N-1: starts them, sends each step, notices failures, stops them."""

    def __init__(self, worker_cls, args, world: int):
        self.world = world
        # The rendezvous store exists before any worker, on a port the OS picked: no race for a free port.
        self.store: dist.TCPStore | None = dist.TCPStore(
            "127.0.0.1", 0, world, is_master=True, wait_for_workers=False,
            timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
        self.port = self.store.port
        self.conns, self.procs = [], []
        self.closed = False
        self.state_ops = None  # hybrid models: rank 0's snapshot copies since the last step (cache/recurrent_state.py)
        try:
            for rank in range(1, world):
                proc = RankProcess(rank)
                self.procs.append(proc)
                self.conns.append(proc.conn)
                try:
                    proc.conn.send(("start", (RankInfo(rank, world, self.port), worker_cls, args)))
                except (BrokenPipeError, OSError):
                    pass  # it died already: check_started says how
        except BaseException:
            self.close()
            raise

    def check_started(self) -> None:
        """Raise with its own cause if a worker reported an error or exited (rank 0 calls this while it
        waits for the workers at the rendezvous)."""
        for rank, (conn, proc) in enumerate(zip(self.conns, self.procs), start=1):
            if conn.poll() or not proc.is_alive():
                kind, payload = self._recv(rank, conn)
                raise self._failure(payload if kind == "error" else f"rank {rank} sent {kind!r} while starting")

    def wait_ready(self) -> None:
        """Block until every worker has built its shard; a worker error or death raises at once."""
        waiting = dict(enumerate(self.conns, start=1))
        deadline = time.monotonic() + START_TIMEOUT_S
        while waiting:
            if time.monotonic() > deadline:
                raise self._failure(f"ranks {sorted(waiting)} did not finish building their shards in "
                                    f"{START_TIMEOUT_S} s")
            for conn in wait_for_connections(list(waiting.values()), timeout=1.0):
                rank = self.conns.index(conn) + 1
                kind, payload = self._recv(rank, conn)
                if kind != "ready":
                    raise self._failure(payload)
                del waiting[rank]

    def send_step(self, inputs, kind: str = "step") -> None:
        """Send a step to every worker: "step" (StepInputs, run eagerly), "graph" (a GraphStep to replay) or
        "capture" ((batch size, query length, GEMV rows) of a graph to capture); before it, "states" (a hybrid
        model's snapshot copies made on rank 0 since the last step) when there are any."""
        dead = [r for r, p in enumerate(self.procs, start=1) if not p.is_alive()]
        if dead or self.closed:
            raise self._failure(f"rank {dead[0]} is not running ({self.procs[dead[0] - 1].how_it_ended()})"
                                if dead else "the worker ranks were stopped")
        ops = self.state_ops() if self.state_ops is not None else None
        for rank, conn in enumerate(self.conns, start=1):
            if conn.poll():  # a worker only speaks to report an error
                raise self._failure(self._recv(rank, conn)[1])
            try:
                if ops:
                    conn.send(("states", ops))
                conn.send((kind, inputs))
            except (BrokenPipeError, OSError):
                raise self._failure(f"rank {rank} closed its pipe") from None

    def down_reason(self) -> str | None:
        """Why the ranks cannot run steps any more (a rank exited, or they were stopped); None while all run.
        Cheap and side-effect free: a health probe may ask it from any thread."""
        if self.closed:
            return "the tensor-parallel worker ranks were stopped"
        dead = [r for r, p in enumerate(self.procs, start=1) if not p.is_alive()]
        return f"tensor-parallel rank {dead[0]} is not running ({self.procs[dead[0] - 1].how_it_ended()})" \
            if dead else None

    def collective_failed(self, exc: BaseException) -> TensorParallelError:
        """The error to raise when a step's collective failed on rank 0: the worker's own reason if one
        reported it."""
        return self._failure(f"a collective failed on rank 0: {type(exc).__name__}: {exc}")

    def _recv(self, rank: int, conn) -> tuple[str, str | None]:
        try:
            return conn.recv()
        except (EOFError, OSError):
            return "error", f"rank {rank} exited without a message ({self.procs[rank - 1].how_it_ended()})"

    def _failure(self, reason: str) -> TensorParallelError:
        """Collect what the workers said, stop them all, and describe the failure."""
        told = []
        for rank, conn in enumerate(self.conns, start=1):
            try:
                if conn.poll(0.5):
                    kind, payload = conn.recv()
                    if kind == "error" and payload and payload not in reason:
                        told.append(payload)
            except (EOFError, OSError):
                pass
        self.close()
        detail = "\n".join([reason, *told])
        return TensorParallelError(f"tensor parallel engine stopped: {detail.strip()}")

    def close(self) -> None:
        """Stop every worker (politely, then by force); idempotent."""
        if self.closed:
            return
        self.closed = True
        for conn in self.conns:
            try:
                conn.send(("stop", None))
            except (BrokenPipeError, OSError):
                pass
        for proc in self.procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self.conns:
            conn.close()
        self.store = None  # the rendezvous server stops once the process group lets go of it too

    def alive(self) -> list[bool]:
        return [p.is_alive() for p in self.procs]
