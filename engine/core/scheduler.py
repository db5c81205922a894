"""Continuous batching: which sequences run in the next forward, and how many tokens each.

One step has a token budget. Running sequences go first, in admission order (a decode costs one
token; an unfinished prefill takes a chunk). Waiting sequences are then admitted FIFO while the
budget, the running cap and the KV pool allow (chunked prefill).

A prompt's chunks are the same whatever else runs: they end at fixed positions, multiples of
`chunk_tokens` (the prefill chunk size, or the budget less one decode token for every other
sequence that may run beside it), and a chunk that does not fit in what is left of this step's
budget waits for the next step instead of being cut short. So a prompt's rows meet the same
kernels and the same attention chunks alone, batched, or after a prefix-cache hit (which ends
at a block boundary: the first chunk runs from it to the next fixed position). The first
prefill in line always fits, so prefills never starve behind decodes.
When a running sequence needs a block and none is free, the newest running sequence is
preempted: its blocks are released (they stay in the prefix cache) and it is recomputed later.

A request of several sequences (n samples, beams: `Sequence.group`) is one unit: its members sit
together in the queues, are admitted, given blocks, preempted and re-admitted together, and a
beam group's members reach their logits in the same step (lockstep) or not at all.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.core.sequence import SeqStatus, Sequence
from engine.kv.manager import KVCacheManager

if TYPE_CHECKING:
    from engine.kv.block_pool import Block


@dataclass(slots=True)
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    prefill_tokens: int = 0
    decode_tokens: int = 0

    def add(self, seq: Sequence, n: int) -> None:
        self.seqs.append(seq)
        self.num_tokens.append(n)
        if seq.is_prefill:
            self.prefill_tokens += n
        else:
            self.decode_tokens += n

    @property
    def total_tokens(self) -> int:
        return self.prefill_tokens + self.decode_tokens


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        prefill_chunk_size: int | None = None,
        decode_tokens: int = 1,
    ):
        """`decode_tokens`: what one decoding sequence can take in a step (1, or 1 + drafts)."""
        self.kv = kv
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.prefill_chunk_size = prefill_chunk_size
        beside = (max_num_seqs - 1) * decode_tokens  # what the other sequences' decodes may take
        self.chunk_tokens = max(
            1, min(prefill_chunk_size or max_num_batched_tokens, max_num_batched_tokens - beside)
        )
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out of the queues (finished, cancelled or failed) and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.kv.free(seq)
        seq.status = SeqStatus.FINISHED

    def replace_members(self, old: list[Sequence], new: list[Sequence]) -> None:
        """A running group's members changed (forks, pruned beams): `new` takes the place of
        `old` in the running queue, in order. Sequences in `old` but not in `new` must already
        have been removed."""
        at = min((self.running.index(s) for s in old if s in self.running), default=len(self.running))
        keep = set(map(id, new))
        rest = [s for s in self.running[at:] if id(s) not in keep]
        for seq in new:
            seq.status = SeqStatus.RUNNING
        self.running[at:] = [*new, *rest]

    def _members(self, seq: Sequence, queue: Iterable[Sequence]) -> list[Sequence]:
        """`seq` and the rest of its group in `queue` (they sit together), in queue order."""
        if seq.group is None:
            return [seq]
        return [s for s in queue if s.group is seq.group]

    def _seats(self) -> int:
        groups = {id(s.group): s.group for s in self.running if s.group is not None}
        plain = sum(1 for s in self.running if s.group is None)
        return plain + sum(g.seats for g in groups.values())

    def _chunk(self, seq: Sequence, done: int, budget: int) -> int:
        """Tokens to run for `seq`, `done` of whose tokens are in the cache. A decode takes what
        it has (its token, and drafts the budget allows); a prefill its chunk up to the next
        fixed position, or nothing this step when that does not fit (see the module doc)."""
        remaining = seq.num_tokens_with_spec - done
        if seq.status is SeqStatus.RUNNING and not seq.is_prefill:
            return min(remaining, budget)
        end = min(seq.num_tokens_with_spec, (done // self.chunk_tokens + 1) * self.chunk_tokens)
        n = end - done
        return n if n <= budget else 0

    def _preempt(self, seq: Sequence, batch: ScheduledBatch) -> None:
        """Preempt `seq` with its whole group: all their blocks go, all are recomputed later."""
        members = self._members(seq, self.running)
        for member in members:
            self.running.remove(member)
            self.kv.free(member)
            member.status = SeqStatus.WAITING
            member.preemptions += 1
        if seq.group is not None:
            seq.group.preemptions += 1
        self.preemptions += 1
        self.waiting.extendleft(reversed(members))
        batch.preempted.extend(members)

    def _plan(self, members: list[Sequence], computed: list[int], budget: int) -> list[int]:
        """Tokens to run for each member given what is already `computed` of it. Members of a
        lockstep group either all reach their last token this step or none does."""
        plan = []
        for seq, done in zip(members, computed):
            n = self._chunk(seq, done, budget)
            plan.append(n)
            budget -= n
        lockstep = members[0].group is not None and members[0].group.lockstep
        if lockstep and any(done + n < s.num_tokens_with_spec for s, done, n in zip(members, computed, plan)):
            plan = [min(n, s.num_tokens_with_spec - done - 1) for s, done, n in zip(members, computed, plan)]
        return plan

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens

        i = 0
        while i < len(self.running) and budget > 0:
            members = self._members(self.running[i], self.running)
            plan = self._plan(members, [s.num_computed_tokens for s in members], budget)
            while self.kv.append_cost(zip(members, plan)) > self.kv.pool.num_free:
                victim = self.running[-1]
                self._preempt(victim, batch)
                if victim in members:
                    break
            if members[0].status is not SeqStatus.RUNNING:
                break  # it was the newest and gave up its own blocks
            for seq, n in zip(members, plan):
                if n > 0:
                    self.kv.append(seq, n)
                    batch.add(seq, n)
                    budget -= n
            i += len(members)

        if batch.preempted:
            return batch  # memory is short: admit nothing new this step
        while self.waiting and budget > 0:
            members = self._members(self.waiting[0], self.waiting)
            seats = members[0].group.seats if members[0].group is not None else 1
            if self._seats() + seats > self.max_num_seqs:
                break
            cached = [self.kv.find_cached_prefix(seq) for seq in members]
            bs = self.kv.block_size
            plan = self._plan(members, [len(c) * bs for c in cached], budget)
            if not any(plan) or not self._can_admit(members, cached, plan):
                break  # its first chunk waits for a step with room (FIFO: nothing overtakes it)
            for seq, hits, n in zip(members, cached, plan):
                self.waiting.popleft()
                self.kv.allocate(seq, hits, n)
                if seq.preemptions == 0 and seq.num_output_tokens == 0:
                    seq.num_cached_tokens = seq.num_computed_tokens
                if seq.first_scheduled_time is None:
                    seq.first_scheduled_time = time.perf_counter()
                seq.status = SeqStatus.RUNNING
                self.running.append(seq)
                if n > 0:
                    batch.add(seq, n)
                    budget -= n
        return batch

    def _can_admit(self, members: list[Sequence], cached: list[list[Block]], plan: list[int]) -> bool:
        """Room for every member's cached prefix plus its planned tokens at once."""
        if len(members) == 1:
            return self.kv.can_allocate(members[0], cached[0], plan[0])
        bs = self.kv.block_size
        need = sum(self.kv.blocks_needed(len(c) * bs + n) - len(c) for c, n in zip(cached, plan))
        reused = {b.block_id for c in cached for b in c if b.ref_cnt == 0}
        return need <= self.kv.pool.num_free - len(reused)
