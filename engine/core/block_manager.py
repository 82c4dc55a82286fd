"""Paged KV block allocation: free list (LRU), ref counts, and prefix caching by chained block hash.

A freed block keeps its contents and hash until it is handed out again, so a later request with
the same prefix can reuse it (the cache costs no memory of its own).

For a hybrid model it also hands out recurrent-state slots (engine/cache/recurrent_state.py): one per request from its
first blocks until it finishes or is preempted. With state snapshots (mamba_cache_mode align) a prefix hit
ends at the last matched block whose state was saved, and that state is restored into the request's slot.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

from onecat.engine.core.sequence import Sequence

if TYPE_CHECKING:
    from onecat.engine.cache.recurrent_state import RecurrentStateCache


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool,
                 states: "RecurrentStateCache | None" = None):
        self.num_blocks = num_blocks  # block 0 is the null block (padding target), never allocated
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(1, num_blocks))
        self.cached: dict[int, int] = {}  # block hash -> block id
        self.prefix_queries = 0  # prompt tokens looked up
        self.prefix_hits = 0  # prompt tokens found
        self.states = states  # a hybrid model's recurrent states (None: no slots to hand out)
        self.free_state_slots = list(range(states.num_slots - 1, -1, -1)) if states else []  # popped: 0 first
        self.snapshots = states if states is not None and states.num_snapshots and enable_prefix_caching else None
        self.pending_restore: dict[str, int] = {}  # request id -> prefix hash of the snapshot its hit ends at

    # ---- accounting ---------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self.free) / (self.num_blocks - 1)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- hashing ------------------------------------------------------------------------------
    @staticmethod
    def chain_hash(parent: int | None, tokens: list[int]) -> int:
        return hash((parent, tuple(tokens)))

    # ---- allocation ---------------------------------------------------------------------------
    def _take_free(self) -> int:
        block, _ = self.free.popitem(last=False)
        h = self.block_hash[block]
        if h is not None:
            if self.cached.get(h) == block:
                del self.cached[h]
            self.block_hash[block] = None
        self.ref_counts[block] = 1
        return block

    def _acquire(self, block: int) -> None:
        if self.ref_counts[block] == 0:
            self.free.pop(block)
        self.ref_counts[block] += 1

    def match_prefix(self, seq: Sequence) -> int:
        """Attach cached blocks for the longest cached prefix of the prompt; returns tokens reused.

        At least one prompt token is always left to compute, so the step produces logits.
        """
        if not self.enable_prefix_caching or seq.params.prompt_logprobs is not None:
            return 0
        bs = self.block_size
        max_blocks = (seq.num_prompt_tokens - 1) // bs
        parent, hits = None, []
        self.prefix_queries += seq.num_prompt_tokens
        for b in range(max_blocks):
            h = self.chain_hash(parent, seq.token_ids[b * bs:(b + 1) * bs])
            block = self.cached.get(h)
            if block is None:
                break
            hits.append((block, h))
            parent = h
        if self.snapshots is not None:  # a hybrid model's hit ends where a state was saved
            while hits and not self.snapshots.has(hits[-1][1]):
                hits.pop()
            if hits:
                self.snapshots.pin(hits[-1][1])
                self.pending_restore[seq.request_id] = hits[-1][1]
        for block, h in hits:
            self._acquire(block)
            seq.block_table.append(block)
            seq.block_hashes.append(h)
        n = len(seq.block_table) * bs
        seq.num_computed_tokens = seq.num_cached_tokens = n
        self.prefix_hits += n
        return n

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix and the lookup counts; the blocks themselves stay where they are."""
        self.cached.clear()
        self.block_hash = [None] * self.num_blocks
        self.prefix_queries = self.prefix_hits = 0
        if self.snapshots is not None:
            self.snapshots.forget_snapshots()

    def ensure_capacity(self, seq: Sequence, num_tokens: int) -> bool:
        """Give `seq` enough blocks for `num_tokens` tokens (and a state slot, for a hybrid model); False (nothing
        taken) if memory is short."""
        need = self.blocks_needed(num_tokens) - len(seq.block_table)
        wants_slot = self.states is not None and seq.state_slot is None
        if need > len(self.free) or (wants_slot and not self.free_state_slots):
            return False
        if wants_slot:
            seq.state_slot = self.free_state_slots.pop()
            key = self.pending_restore.pop(seq.request_id, None)
            if key is not None:
                self.states.restore(key, seq.state_slot, seq.num_computed_tokens)
        if need > 0:
            seq.block_table.extend(self._take_free() for _ in range(need))
        return True

    def register_computed(self, seq: Sequence) -> None:
        """Publish the hashes of blocks that became full and computed, for later prefix hits."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        full = min(seq.num_computed_tokens, seq.num_tokens) // bs
        while len(seq.block_hashes) < full:
            b = len(seq.block_hashes)
            parent = seq.block_hashes[-1] if seq.block_hashes else None
            h = self.chain_hash(parent, seq.token_ids[b * bs:(b + 1) * bs])
            seq.block_hashes.append(h)
            block = seq.block_table[b]
            if h not in self.cached:
                self.cached[h] = block
                self.block_hash[block] = h
        done = seq.num_computed_tokens
        if self.snapshots is not None and seq.state_slot is not None and done and done % bs == 0 \
                and len(seq.block_hashes) == done // bs:  # the state is the one after exactly these blocks
            self.snapshots.save(seq.state_slot, seq.block_hashes[-1], done)

    def aligned_chunk(self, start: int, n: int) -> int:
        """How many of `n` tokens from `start` to compute this step: with state snapshots, up to the last block
        boundary the chunk crosses (so the state there can be saved), else all `n`."""
        if self.snapshots is None:
            return n
        end = (start + n) // self.block_size * self.block_size
        return end - start if end > start else n

    def free_seq(self, seq: Sequence) -> None:
        # Release in reverse so the tail of a sequence is evicted before its (more shareable) head.
        for block in reversed(seq.block_table):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free[block] = None
        seq.block_table = []
        seq.block_hashes = []
        if seq.state_slot is not None:
            self.free_state_slots.append(seq.state_slot)
            seq.state_slot = None
        key = self.pending_restore.pop(seq.request_id, None)
        if key is not None:  # matched a snapshot but never got a slot: it no longer needs it kept
            self.snapshots.unpin(key)
