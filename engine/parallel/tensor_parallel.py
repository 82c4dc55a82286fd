"""What an engine's `Worker` does differently as one of N tensor-parallel ranks (tensor_parallel_size = N > 1).

Every rank builds the model on the meta device, shards it there (sharding.py) and loads only its share
from the checkpoint (shard_loading.py), before any CPU weight packing; the KV cache holds the rank's own
KV heads. Rank 0 (the user's process) then
starts ranks 1..N-1 (runtime.py) with its block count, so every rank's cache has the same blocks and
one block table serves all. With CUDA graphs on, rank 0 tells every rank which graph to capture or
replay, with the step's inputs, so all ranks capture and replay the same graphs in step (their
collectives are inside). GPU ranks whose memory can be mapped by each other sum small tensors with the
one-shot kernel of peer_collectives.py, NCCL the rest.
"""
from __future__ import annotations

import dataclasses
import os
import weakref

import torch
import torch.distributed as dist

from onecat.engine.errors import ConfigError
from onecat.engine.parallel.collectives import Collectives, SharedMemoryRanks, shared_memory_usable, shm_name
from onecat.engine.parallel.runtime import (RankInfo, WorkerRanks, backend_for, init_group, rank_device,
                                            ranks_share_device, threads_per_rank, worker_rank)
from onecat.engine.parallel.shard_loading import ShardLoader
from onecat.engine.parallel.sharding import attention_heads, linear_attention_heads, shard_model, split_range


def peer_collectives_unavailable(world: int, device: torch.device) -> str | None:
    """Why this GPU rank cannot take part in the peer-buffer collectives, or None (checked on every rank;
    they are used only when no rank has a reason)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return "Triton is not installed"
    if ranks_share_device():
        return None
    own = device.index or 0
    first = own - (dist.get_rank() if dist.is_initialized() else 0)
    blocked = [g for g in range(first, first + world) if g != own and not torch.cuda.can_device_access_peer(own, g)]
    return f"GPU {own} cannot access GPUs {blocked} directly (no NVLink / PCIe peer access)" if blocked else None


class TensorParallel:
    def __init__(self, world: int, device: torch.device, peer_collectives: bool = True):
        info = worker_rank()
        self.world, self.rank = world, info.rank if info is not None else 0
        self.is_worker = info is not None
        if device.type == "cuda":
            first = device.index or 0
            if first + world > torch.cuda.device_count() and not ranks_share_device():
                raise ConfigError(f"tensor_parallel_size={world} from {device} needs GPUs {first}..{first + world - 1}"
                                  f" but this host has {torch.cuda.device_count()}; lower tensor_parallel_size")
        elif device.type != "cpu":
            raise ConfigError(f"tensor parallel runs on CUDA GPUs (NCCL) or CPU processes (gloo), not {device}")
        if not self.is_worker and dist.is_initialized():
            raise ConfigError("this process already holds a tensor-parallel engine (one process group per "
                              "process); close it first")
        self.device = rank_device(device, self.rank)
        self.workers: WorkerRanks | None = None
        self.full_vocab: tuple | None = None  # (embedding, LM head) unsharded, for a DFlash drafter on rank 0
        self.model: torch.nn.Module | None = None  # this rank's shard (shard())
        self.collectives = Collectives()  # what the sharded layers sum and gather through
        self.shared_memory = device.type == "cpu" and shared_memory_usable()
        self.want_peer = peer_collectives and device.type == "cuda"
        self.peer_reason: str | None = None if self.want_peer else "off (disable_custom_all_reduce) or not CUDA"
        if device.type == "cpu":
            torch.set_num_threads(threads_per_rank(world))
        if self.is_worker:
            init_group(info, self.device)  # rank 0 made the shared-memory segment before it joined
            self._setup_peer_collectives()
            if self.shared_memory:
                self.collectives.shm = SharedMemoryRanks(shm_name(info.port), self.rank, world, create=False,
                                                         tracked=False)
                parent = os.getppid()
                self.collectives.shm.peers_gone = lambda: None if os.getppid() == parent else "rank 0 exited"

    def _setup_peer_collectives(self) -> None:
        """Right after joining the group, on every rank alike (it is a collective): map each other's
        buffers when every rank can; otherwise every collective stays on NCCL."""
        if not self.want_peer:
            return
        from onecat.engine.parallel.peer_collectives import PeerBuffers

        reasons = [None] * self.world
        dist.all_gather_object(reasons, peer_collectives_unavailable(self.world, self.device))
        blocked = [f"rank {r}: {why}" for r, why in enumerate(reasons) if why]
        if blocked:
            self.peer_reason = "; ".join(blocked)
            return
        self.collectives.peer = PeerBuffers.over_group(self.rank, self.world, self.device)

    def shard(self, model: torch.nn.Module, keep_full_vocab: bool = False):
        """Keep this rank's share of a model built on the meta device (shapes only) and return the loader
        that slices the checkpoint to it (shard_loading.py). `keep_full_vocab` (rank 0 with a DFlash
        drafter): the loader also keeps whole copies of the embedding and LM head (see `full_vocab`)."""
        shard_model(model, self.rank, self.world, self.collectives)
        self.model = model
        return ShardLoader(model, keep_full_vocab=keep_full_vocab and not self.is_worker)

    def kv_config(self, model_config):
        """The model config as this rank's KV cache sees it: only the rank's KV heads."""
        _, kv = attention_heads(model_config.num_attention_heads, model_config.num_key_value_heads, self.rank,
                                self.world)
        return dataclasses.replace(model_config, num_key_value_heads=len(kv))

    def start_workers(self, worker_cls, args, num_blocks: int) -> WorkerRanks:
        """Rank 0: start ranks 1..N-1 (each builds a `worker_cls`, the Worker class) with this engine's
        settings (`args`, EngineArgs) and block count, join the group, and wait until every rank has built
        its shard."""
        worker_args = args.model_copy(update={"speculative_config": None,  # drafting is rank 0's
                                              "num_kv_blocks": num_blocks})
        self.workers = WorkerRanks(worker_cls, worker_args, self.world)
        # An engine dropped or left open at interpreter exit still stops its workers, then unlinks its
        # shared memory and leaves the group (no leaked-segment warning, no orphan process).
        self._shut_down = weakref.finalize(self, _shut_down, self.workers, self.collectives)
        states = getattr(self.model, "states", None)
        if states is not None:  # a hybrid model: the workers repeat rank 0's recurrent-state snapshot copies
            states.journal = []
            self.workers.state_ops = states.take_journal
        try:
            if self.shared_memory:
                self.collectives.shm = SharedMemoryRanks(shm_name(self.workers.port), 0, self.world, create=True)
                workers = self.workers
                self.collectives.shm.peers_gone = lambda: next(
                    (f"rank {r} exited" for r, alive in enumerate(workers.alive(), start=1) if not alive), None)
            init_group(RankInfo(0, self.world, self.workers.port), self.device, store=self.workers.store,
                       check_ranks=self.workers.check_started)
            self._setup_peer_collectives()
            self.workers.wait_ready()
        except BaseException:
            self.close()
            raise
        return self.workers

    def describe(self, model_config) -> dict:
        heads = [attention_heads(model_config.num_attention_heads, model_config.num_key_value_heads, r, self.world)
                 for r in range(self.world)]
        peer = ("one-shot kernel for tensors up to "
                f"{self.collectives.peer.capacity_bytes >> 10} KiB" if self.collectives.peer else self.peer_reason)
        return {"size": self.world, "backend": backend_for(self.device), "shared_memory": self.shared_memory,
                "gpu_peer_collectives": peer, "ranks_share_device": ranks_share_device() or None,
                "threads_per_rank": torch.get_num_threads(),
                "query_heads": [len(q) for q, _ in heads], "kv_heads": [kv for _, kv in heads],
                "intermediate": [split_range(model_config.intermediate_size, r, self.world) for r in range(self.world)],
                "linear_heads": self._linear_heads(model_config),
                "workers_alive": self.workers.alive() if self.workers is not None else None}

    def _linear_heads(self, model_config) -> list[dict] | None:
        """Each rank's Gated DeltaNet value and key heads (hybrid models), else None."""
        v_heads, k_heads = model_config.raw.get("linear_num_value_heads"), model_config.raw.get("linear_num_key_heads")
        if not v_heads or not k_heads:
            return None
        return [dict(zip(("value", "key"), linear_attention_heads(v_heads, k_heads, r, self.world)))
                for r in range(self.world)]

    def close(self) -> None:
        if self.workers is not None:
            self._shut_down()
        else:
            _shut_down(None, self.collectives)


def _shut_down(workers: WorkerRanks | None, collectives: Collectives) -> None:
    """In this order: stop the workers (they let go of the segment and the group), unlink the shared
    memory, leave the group. Runs once: from close(), when the engine is collected, or at exit."""
    if workers is not None:
        workers.close()
    collectives.close()
    if dist.is_initialized():
        dist.destroy_process_group()
