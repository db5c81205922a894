"""Per-sequence block tables on top of the block pool, and prefix caching.

Admission checks are paired with actions (`can_allocate`/`allocate`, `can_append`/`append`) so
the scheduler decides before anything changes. Prefix caching keys only full blocks whose
tokens are all committed to the cache, chained so a block's key names its entire prefix; a hit
never covers the last prompt token, which is always recomputed to produce the first logits.

A key is the SHA-256 of (the parent block's key, the block's tokens), as vLLM's since
CVE-2025-25183 (with a 64-bit hash two different prefixes can be made to collide, and one request
would attend to K/V another's prompt wrote), and of the kernels that computed the block: a
prompt's rows run the kernels its whole length chooses, every row after it the one-row kernels
(engine/kernels/policy.py), and kernels round differently; so a block is shared only with a
prompt that would have computed every one of its positions with the same kernels, and a reply is
the same bits cached or alone. Where the kernel table keeps one kernel at every row count (float32
models; the GGUF formats where kvk runs every row) the kernels never split a key.

Forks (n samples, beams) share all of a sequence's blocks by ref count. A sequence about to
write into a shared block first copies it (copy-on-write): only the last, partly filled block
can be written, so full shared blocks stay shared for good.
"""

from __future__ import annotations

import hashlib
import time
from array import array
from collections.abc import Callable, Iterable
from typing import Protocol

from engine.events import BlockEvent
from engine.kv.block_pool import Block, BlockPool
from engine.limits import blocks_for_tokens


def kernel_runs(prompt_tokens: int, start: int, count: int) -> list[tuple[int, int]]:
    """[(positions, the row count their kernels are chosen for)] of `count` positions from
    `start` in a sequence whose prompt is `prompt_tokens` long: a prompt's positions run the
    kernels its whole length picks, the positions after it the one-row kernels. The runner
    computes with this rule and the prefix cache keys blocks by it: one rule, so that a block is
    served only where its positions would be computed with the same kernels."""
    in_prompt = min(count, max(0, prompt_tokens - start))
    return [(m, rows_for) for m, rows_for in ((in_prompt, prompt_tokens), (count - in_prompt, 1)) if m]


class BlockTableOwner(Protocol):
    """What the manager reads and writes of a sequence (engine.core.sequence.Sequence): its
    committed tokens, how many of them are in the cache, and the blocks that hold them."""

    seq_id: int
    token_ids: list[int]
    spec_token_ids: list[int]
    num_computed_tokens: int
    block_table: list[Block]
    peak_blocks: int
    cow_copies: int
    block_keys: list[tuple[tuple[int, ...], bytes]]  # its full blocks' prefix keys, memoised

    @property
    def num_tokens(self) -> int: ...


# The parent key of a sequence's first block.
ROOT_KEY = b"kvscope-prefix-root"


def chain_hash(parent: bytes | None, tokens: tuple[int, ...], kernels: bytes = b"") -> bytes:
    """Key of a full block: SHA-256 of its parent's key, its tokens (as 64-bit ints) and the
    kernels that computed them, so a key names the block's entire prefix and two prefixes share
    one only by a SHA-256 collision."""
    digest = hashlib.sha256(ROOT_KEY if parent is None else parent)
    digest.update(array("q", tokens).tobytes())
    digest.update(kernels)
    return digest.digest()


# rows -> the kernels rows chosen for that many run (KernelPolicy.kernels_at)
KernelsAt = Callable[[int], bytes]


class KVCacheManager:
    def __init__(
        self,
        pool: BlockPool,
        enable_prefix_caching: bool = True,
        copy_block: Callable[[int, int], None] | None = None,
        kernels_at: KernelsAt | None = None,
    ):
        self.pool = pool
        # which kernels compute a position (see the module doc); None: one kernel for every row
        self.kernels_at = kernels_at
        self.block_size = pool.block_size
        self.enable_prefix_caching = enable_prefix_caching
        # Copies one block's K/V (src id, dst id) for copy-on-write; None keeps bookkeeping only.
        self.copy_block = copy_block
        self.queries = 0  # prefix-cache lookups (one per admitted sequence)
        self.hit_tokens = 0
        self.query_tokens = 0
        self.cow_copies = 0

    def blocks_needed(self, num_tokens: int) -> int:
        return blocks_for_tokens(num_tokens, self.block_size)

    # ---- prefix cache ----------------------------------------------------------------------
    def _block_keys(self, seq: BlockTableOwner, num_full_blocks: int) -> list[bytes]:
        """The chained keys of the sequence's first full blocks. Kept on the sequence with the
        tokens each was computed from, so a long sequence does not rehash its whole prefix each
        time a block fills. Keys are only asked for committed tokens (with a round's accepted
        drafts, committed just after this), and a sequence's tokens only grow, so checking the
        newest key's tokens is enough; should they differ, every key is recomputed."""
        memo, bs = seq.block_keys, self.block_size
        tokens = seq.token_ids
        if num_full_blocks * bs > len(tokens):  # a round's accepted drafts, committed after this
            tokens = tokens + seq.spec_token_ids
        if memo:
            last = len(memo) - 1
            if memo[last][0] != tuple(tokens[last * bs : (last + 1) * bs]):
                memo.clear()
        parent = memo[-1][1] if memo else None
        prompt = getattr(seq, "num_prompt_tokens", len(tokens))  # a drafter's sequence: never cached
        for i in range(len(memo), num_full_blocks):
            block = tuple(tokens[i * bs : (i + 1) * bs])
            parent = chain_hash(parent, block, self._block_kernels(prompt, i))
            memo.append((block, parent))
        return [key for _, key in memo[:num_full_blocks]]

    def _block_kernels(self, prompt_tokens: int, index: int) -> bytes:
        """The kernels that compute block `index`'s positions in a sequence whose prompt is
        `prompt_tokens` long (kernel_runs), as a key's part."""
        if self.kernels_at is None:
            return b""
        runs = kernel_runs(prompt_tokens, index * self.block_size, self.block_size)
        names = [self.kernels_at(rows_for) for _, rows_for in runs]
        if names[0] == names[-1]:
            return names[0]
        return b"%d|%s|%s" % (runs[0][0], names[0], names[1])  # the prompt ends inside

    def find_cached_prefix(self, seq: BlockTableOwner) -> list[Block]:
        """Longest run of cached full blocks matching the sequence's start, never reaching its
        last token (that one must run through the model to give logits)."""
        if not self.enable_prefix_caching:
            return []
        hits = []
        for key in self._block_keys(seq, (seq.num_tokens - 1) // self.block_size):
            block = self.pool.lookup(key)
            if block is None:
                break
            hits.append(block)
        return hits

    # ---- admission -------------------------------------------------------------------------
    def can_allocate(self, seq: BlockTableOwner, cached: list[Block], num_new_tokens: int) -> bool:
        """Room for the cached prefix plus `num_new_tokens`? Cached-free blocks being reused do
        not count as free space (they leave the free queue)."""
        total = len(cached) * self.block_size + num_new_tokens
        reused_from_free = sum(1 for b in cached if b.ref_cnt == 0)
        return self.blocks_needed(total) - len(cached) <= self.pool.num_free - reused_from_free

    def allocate(self, seq: BlockTableOwner, cached: list[Block], num_new_tokens: int) -> None:
        assert not seq.block_table and seq.num_computed_tokens == 0
        self.queries += 1
        self.query_tokens += seq.num_tokens
        self.hit_tokens += len(cached) * self.block_size
        self.pool.touch(cached, seq.seq_id, 0)
        seq.block_table = list(cached)
        seq.num_computed_tokens = len(cached) * self.block_size
        self.append(seq, num_new_tokens)

    def can_append(self, seq: BlockTableOwner, num_new_tokens: int) -> bool:
        return self.append_cost([(seq, num_new_tokens)]) <= self.pool.num_free

    def append_cost(self, plans: Iterable[tuple[BlockTableOwner, int]]) -> int:
        """Free blocks that appending `n` tokens to each `seq` takes, copies included. Of `w`
        writers into one shared block held `r` times, min(w, r - 1) copy it: the last holder to
        write finds it no longer shared."""
        need = 0
        writers: dict[int, tuple[Block, int]] = {}  # block id -> (the block, its writers)
        for seq, n in plans:
            need += max(0, self.blocks_needed(seq.num_computed_tokens + n) - len(seq.block_table))
            shared = self._shared_write_target(seq, n)
            if shared is not None:
                writers[shared.block_id] = (shared, writers.get(shared.block_id, (shared, 0))[1] + 1)
        return need + sum(min(w, block.ref_cnt - 1) for block, w in writers.values())

    def append(self, seq: BlockTableOwner, num_new_tokens: int) -> None:
        """Ensure blocks cover the next `num_new_tokens` slots, and that the one written first is
        the sequence's own."""
        if self._shared_write_target(seq, num_new_tokens) is not None:
            self._copy_on_write(seq, seq.num_computed_tokens // self.block_size)
        need = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        if need > 0:
            seq.block_table.extend(self.pool.allocate(need, seq.seq_id))
        seq.peak_blocks = max(seq.peak_blocks, len(seq.block_table))

    # ---- sharing between the sequences of a group --------------------------------------------
    def share(self, parent: BlockTableOwner, child: BlockTableOwner) -> None:
        """`child` (a fork of `parent`, same tokens) takes a reference on all the parent's blocks."""
        assert not child.block_table
        child.block_table = list(parent.block_table)
        child.num_computed_tokens = parent.num_computed_tokens
        child.peak_blocks = len(child.block_table)
        self.pool.touch(child.block_table, child.seq_id, 0)

    def _shared_write_target(self, seq: BlockTableOwner, num_new_tokens: int) -> Block | None:
        """The block the next write lands in, when it already exists and others hold it too."""
        index = seq.num_computed_tokens // self.block_size
        if num_new_tokens <= 0 or index >= len(seq.block_table):
            return None
        block = seq.block_table[index]
        return block if block.ref_cnt > 1 else None

    def _copy_on_write(self, seq: BlockTableOwner, index: int) -> None:
        src = seq.block_table[index]
        (dst,) = self.pool.allocate(1, seq.seq_id)
        if self.copy_block is not None:
            self.copy_block(src.block_id, dst.block_id)
        dst.num_tokens = src.num_tokens
        seq.block_table[index] = dst
        self.pool._emit(
            BlockEvent(
                "cow",
                (dst.block_id,),
                seq.seq_id,
                index * self.block_size,
                index * self.block_size + src.num_tokens,
                (src.num_tokens,),
                time.perf_counter(),
                (src.block_id,),
            )
        )
        self.pool.free([src], seq.seq_id)
        seq.cow_copies += 1
        self.cow_copies += 1

    def slot_ids(self, block_table: list[Block], start: int, count: int) -> list[int]:
        """The flat slots (block id * block size + offset) of positions [start, start + count)."""
        bs, table = self.block_size, block_table
        return [table[p // bs].block_id * bs + p % bs for p in range(start, start + count)]

    # ---- after the forward -----------------------------------------------------------------
    def commit(
        self, seq: BlockTableOwner, num_new_tokens: int, num_kept: int | None = None, cache: bool = True
    ) -> None:
        """`num_new_tokens` more of the sequence's tokens now have K/V in their slots. With
        speculative decoding only the first `num_kept` of them were verified: the rest of the
        written slots are rolled back, and only verified tokens can enter the prefix cache.
        `cache=False`: none of them does (K/V a steered forward wrote are not the model's)."""
        bs = self.block_size
        start, end = seq.num_computed_tokens, seq.num_computed_tokens + num_new_tokens
        self._set_fills(seq, start, end, "append")
        kept_end = end if num_kept is None else start + num_kept
        if kept_end < end:
            self._set_fills(seq, kept_end, end, "rollback", fill_to=kept_end)
            needed = self.blocks_needed(kept_end)
            if len(seq.block_table) > needed:
                emptied = seq.block_table[needed:]
                del seq.block_table[needed:]
                self.pool.free(list(reversed(emptied)), seq.seq_id)
        seq.num_computed_tokens = kept_end
        if self.enable_prefix_caching and cache:
            self._cache_full_blocks(seq, start // bs, kept_end // bs)

    def _set_fills(
        self, seq: BlockTableOwner, start: int, end: int, op: str, fill_to: int | None = None
    ) -> None:
        """Fill levels of the blocks covering [start, end) as if `fill_to` (default `end`)
        tokens were written, reported as one event."""
        bs, fill_to = self.block_size, end if fill_to is None else fill_to
        first, last = start // bs, (end - 1) // bs
        touched = seq.block_table[first : last + 1]
        for i, block in enumerate(touched, start=first):
            block.num_tokens = max(0, min(bs, fill_to - i * bs))
        self.pool._emit(
            BlockEvent(
                op,
                tuple(b.block_id for b in touched),
                seq.seq_id,
                start,
                end,
                tuple(b.num_tokens for b in touched),
                time.perf_counter(),
            )
        )

    def _cache_full_blocks(self, seq: BlockTableOwner, first: int, num_full: int) -> None:
        if num_full <= first:
            return
        keys = self._block_keys(seq, num_full)
        for i in range(first, num_full):
            block = seq.block_table[i]
            if block.block_hash is None:
                self.pool.cache(block, keys[i], seq.seq_id, i * self.block_size)

    def free(self, seq: BlockTableOwner) -> None:
        """Release the sequence's blocks, tail first (see BlockPool.free)."""
        if seq.block_table:
            self.pool.free(list(reversed(seq.block_table)), seq.seq_id)
        seq.block_table = []
        seq.num_computed_tokens = 0
