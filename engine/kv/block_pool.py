"""The KV block pool: which physical blocks are free, used (by ref count) or cached for reuse.

Bookkeeping only; the tensors live in `engine.model.kv_storage.PagedKVStorage`, indexed by the
same block ids. Every mutation is reported as a `BlockEvent` so the app's page map is exact, and
each block keeps what those events told of it (where it sits in its sequence, the block it was
copied from, when it last changed): the server's snapshot of the pool reads it there.

Free queue (LRU, front = reused first). A block whose ref count drops to 0 keeps its prefix hash
("cached-free"): a later request with the same prefix can take it back without recomputing.
It loses the hash only when the queue hands it out for new data (lazy eviction). Freed blocks
without a hash go to the front (they hold nothing worth keeping), hashed ones to the back, so
the least recently used cached block is evicted first.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

from engine.events import BlockEvent


@dataclass(slots=True, eq=False)
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: Hashable | None = None
    num_tokens: int = 0  # slots written (fill level)
    # As its events told (BlockEvent.block_start): the position of its first slot in its sequence
    # (-1: never written), the shared block a copy-on-write copied into it, its last change.
    token_start: int = -1
    copied_from: int | None = None
    touched_t: float = 0.0


class PoolExhausted(RuntimeError):
    pass


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, emit: Callable[[BlockEvent], None] | None = None):
        if num_blocks < 1:
            raise ValueError("the KV pool needs at least one block")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[Hashable, Block] = {}
        self._sink = emit or (lambda event: None)
        self.evictions = 0

    def _emit(self, event: BlockEvent) -> None:
        """Every block event, this pool's and its KV manager's: noted on the blocks, then sent."""
        for i, block_id in enumerate(event.block_ids):
            block = self.blocks[block_id]
            block.touched_t = event.t
            if event.op in ("append", "share", "cow"):
                block.token_start = event.block_start(i, self.block_size)
            if event.op == "cow" and i < len(event.src_block_ids):
                block.copied_from = event.src_block_ids[i]
            elif event.op == "allocate":
                block.copied_from = None
        self._sink(event)

    # ---- queries ---------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached_free(self) -> int:
        return sum(1 for i in self._free if self.blocks[i].block_hash is not None)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def lookup(self, block_hash: Hashable) -> Block | None:
        return self._cached.get(block_hash)

    def free_order(self) -> list[int]:
        """Block ids in the order they will be handed out (tests assert exact eviction order)."""
        return list(self._free)

    # ---- mutations -------------------------------------------------------------------------
    def allocate(self, n: int, seq_id: int | None) -> list[Block]:
        if n > len(self._free):
            raise PoolExhausted(f"asked for {n} KV blocks, {len(self._free)} free")
        taken, evicted = [], []
        for _ in range(n):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            assert block.ref_cnt == 0, "a block in the free queue must have no references"
            if block.block_hash is not None:
                del self._cached[block.block_hash]
                block.block_hash = None
                evicted.append(block_id)
            block.ref_cnt = 1
            block.num_tokens = 0
            taken.append(block)
        now = time.perf_counter()
        if evicted:
            self.evictions += len(evicted)
            self._emit(BlockEvent("evict", tuple(evicted), seq_id, t=now))
        if taken:
            self._emit(BlockEvent("allocate", tuple(b.block_id for b in taken), seq_id, t=now))
        return taken

    def touch(self, blocks: Sequence[Block], seq_id: int | None, token_start: int = 0) -> None:
        """Take a reference on cached blocks (a prefix-cache hit)."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1
        if blocks:
            self._emit(
                BlockEvent(
                    "share",
                    tuple(b.block_id for b in blocks),
                    seq_id,
                    token_start,
                    token_start + len(blocks) * self.block_size,
                    tuple(b.num_tokens for b in blocks),
                    time.perf_counter(),
                )
            )

    def free(self, blocks: Sequence[Block], seq_id: int | None) -> None:
        """Drop one reference from each block; blocks reaching 0 join the free queue.

        Callers pass a sequence's blocks tail first, so its last blocks are evicted before its
        prefix (a later request is more likely to share the prefix)."""
        for block in blocks:
            assert block.ref_cnt > 0, f"double free of block {block.block_id}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = None
                if block.block_hash is None:
                    self._free.move_to_end(block.block_id, last=False)
                    block.num_tokens = 0
        if blocks:
            self._emit(BlockEvent("free", tuple(b.block_id for b in blocks), seq_id, t=time.perf_counter()))

    def cache(self, block: Block, block_hash: Hashable, seq_id: int | None, token_start: int) -> None:
        """Register a full, committed block under its chained prefix hash."""
        assert block.ref_cnt > 0 and block.num_tokens == self.block_size
        if block.block_hash is not None or block_hash in self._cached:
            return  # already cached (or an identical block is): keep the first
        block.block_hash = block_hash
        self._cached[block_hash] = block
        self._emit(
            BlockEvent(
                "cache",
                (block.block_id,),
                seq_id,
                token_start,
                token_start + self.block_size,
                t=time.perf_counter(),
            )
        )

    def check_invariants(self) -> None:
        """Conservation and ref counts; tests call it after every operation."""
        free_ids = set(self._free)
        assert len(free_ids) == len(self._free)
        for block in self.blocks:
            assert block.ref_cnt >= 0
            assert (block.ref_cnt == 0) == (block.block_id in free_ids), f"block {block.block_id} misfiled"
            if block.block_hash is not None:
                assert self._cached.get(block.block_hash) is block
        assert len(self._cached) == sum(1 for b in self.blocks if b.block_hash is not None)
        assert self.num_used + self.num_free == self.num_blocks
