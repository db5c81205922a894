"""The KV pool's per-block state, folded exactly from the engine's block events."""

from __future__ import annotations

import numpy as np

from engine.events import BLOCK_OPS, BlockEvent


class PageMap:
    """Per-block state of the KV pool, folded exactly from block events.

    Arrays are indexed by block id. `owners[b]` lists the sequences holding a reference (more
    than one when a prefix is shared). `token_start[b]` is the position of the block's first
    token in its sequence (-1 when the block holds nothing); it covers `fill[b]` tokens.
    """

    def __init__(self, num_blocks: int = 0, block_size: int = 16, bytes_per_block: int = 0) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.bytes_per_block = bytes_per_block
        self.ref_count = np.zeros(num_blocks, np.int32)
        self.fill = np.zeros(num_blocks, np.int32)
        self.cached = np.zeros(num_blocks, np.bool_)
        self.token_start = np.full(num_blocks, -1, np.int64)
        self.first_owner = np.full(num_blocks, -1, np.int64)  # colour key of the block
        self.last_op = np.full(num_blocks, -1, np.int8)  # index into BLOCK_OPS
        self.touched_t = np.full(num_blocks, -np.inf)  # engine time of the last mutation
        # The shared block a copy-on-write copied into this one (-1: not a copy). Kept while the
        # block is referenced, so the map can mark where a fork's own blocks branched off.
        self.copied_from = np.full(num_blocks, -1, np.int64)
        self.owners: list[list[int]] = [[] for _ in range(num_blocks)]

    # ---- folding ---------------------------------------------------------------------------
    def apply(self, event: BlockEvent) -> list[str]:
        """Fold one block event; returns messages for events that contradict the state."""
        problems: list[str] = []
        self._grow_to(max(event.block_ids, default=-1) + 1)
        fills = event.fills or self._fills_from_range(event)
        op = event.op
        for i, block in enumerate(event.block_ids):
            if op == "allocate":
                if self.ref_count[block] != 0:
                    problems.append(f"block {block} allocated while still referenced")
                self.ref_count[block] = 1
                self.owners[block] = [event.seq_id] if event.seq_id is not None else []
                self.fill[block] = 0
                self.cached[block] = False  # a fresh allocation never carries a prefix hash
                self.token_start[block] = -1
                self.copied_from[block] = -1
            elif op in ("append", "share"):
                if op == "share":
                    self.ref_count[block] += 1
                    if event.seq_id is not None:
                        self.owners[block].append(event.seq_id)
                elif self.ref_count[block] == 0:
                    problems.append(f"block {block} written while free")
                if i < len(fills):
                    self.fill[block] = fills[i]
                self.token_start[block] = event.block_start(i, self.block_size)
            elif op == "rollback":
                # Rejected speculative slots: the block keeps only its verified tokens. A block
                # left empty keeps its reference until the "free" that follows.
                if i < len(fills):
                    self.fill[block] = fills[i]
                if self.fill[block] == 0:
                    self.token_start[block] = -1
            elif op == "cow":
                # The block allocated just before now holds a copy of the shared source's
                # written slots and takes its place in the writer's table from token_start.
                if self.ref_count[block] == 0:
                    problems.append(f"block {block} copied into while free")
                if i < len(fills):
                    self.fill[block] = fills[i]
                self.token_start[block] = event.block_start(i, self.block_size)
                if i < len(event.src_block_ids):
                    self.copied_from[block] = event.src_block_ids[i]
            elif op == "free":
                if self.ref_count[block] <= 0:
                    problems.append(f"block {block} freed while not referenced")
                    continue
                self.ref_count[block] -= 1
                if event.seq_id in self.owners[block]:
                    self.owners[block].remove(event.seq_id)
                if self.ref_count[block] == 0:
                    self.copied_from[block] = -1
                if self.ref_count[block] == 0 and not self.cached[block]:
                    self.fill[block] = 0  # no hash: its contents are unreachable now
                    self.token_start[block] = -1
            elif op == "cache":
                self.cached[block] = True
            elif op == "evict":
                self.cached[block] = False
                self.fill[block] = 0
                self.token_start[block] = -1
            else:
                problems.append(f"unknown block op {op!r}")
                continue
            self.first_owner[block] = self.owners[block][0] if self.owners[block] else -1
            self.last_op[block] = BLOCK_OPS.index(op)
            self.touched_t[block] = event.t
        return problems

    def _fills_from_range(self, event: BlockEvent) -> tuple[int, ...]:
        """Fill levels implied by an append/share's token range, for events without `fills`."""
        if event.op not in ("append", "share"):
            return ()
        fills = []
        for i in range(len(event.block_ids)):
            start = event.block_start(i, self.block_size)
            fills.append(max(0, min(event.token_end, start + self.block_size) - start))
        return tuple(fills)

    def _grow_to(self, n: int) -> None:
        if n <= self.num_blocks:
            return
        extra = n - self.num_blocks
        self.ref_count = np.concatenate([self.ref_count, np.zeros(extra, np.int32)])
        self.fill = np.concatenate([self.fill, np.zeros(extra, np.int32)])
        self.cached = np.concatenate([self.cached, np.zeros(extra, np.bool_)])
        self.token_start = np.concatenate([self.token_start, np.full(extra, -1, np.int64)])
        self.first_owner = np.concatenate([self.first_owner, np.full(extra, -1, np.int64)])
        self.last_op = np.concatenate([self.last_op, np.full(extra, -1, np.int8)])
        self.touched_t = np.concatenate([self.touched_t, np.full(extra, -np.inf)])
        self.copied_from = np.concatenate([self.copied_from, np.full(extra, -1, np.int64)])
        self.owners.extend([] for _ in range(extra))
        self.num_blocks = n

    # ---- counters --------------------------------------------------------------------------
    @property
    def used_blocks(self) -> int:
        return int(np.count_nonzero(self.ref_count > 0))

    @property
    def shared_blocks(self) -> int:
        return int(np.count_nonzero(self.ref_count > 1))

    @property
    def cached_free_blocks(self) -> int:
        return int(np.count_nonzero((self.ref_count == 0) & self.cached))

    @property
    def free_blocks(self) -> int:
        """Blocks with no reference (including cached-free ones), as in KVStats."""
        return self.num_blocks - self.used_blocks

    @property
    def used_slots(self) -> int:
        return int(self.fill[self.ref_count > 0].sum())

    @property
    def utilisation(self) -> float:
        """Written slots over the slots of used blocks (internal fragmentation shows as < 1)."""
        used = self.used_blocks
        return self.used_slots / (used * self.block_size) if used else 1.0

    @property
    def used_bytes(self) -> int:
        return self.used_blocks * self.bytes_per_block

    @property
    def pool_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    def token_range(self, block: int) -> tuple[int, int] | None:
        """Positions [start, end) the block holds in its sequence(s), or None when empty."""
        if self.token_start[block] < 0 or self.fill[block] == 0:
            return None
        start = int(self.token_start[block])
        return start, start + int(self.fill[block])
