"""Continuous batching: which sequences run in the next forward, and how many tokens each.

One step has a token budget. Running sequences go first, in admission order (a decode costs one
token; an unfinished prefill takes a chunk). Waiting sequences are then admitted FIFO while the
budget, the running cap and the KV pool allow, their prompts chunked to fit (chunked prefill).
When a running sequence needs a block and none is free, the newest running sequence is
preempted: its blocks are released (they stay in the prefix cache) and it is recomputed later.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from engine.kv.manager import KVCacheManager
from engine.sequence import SeqStatus, Sequence


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
    ):
        self.kv = kv
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.prefill_chunk_size = prefill_chunk_size
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

    def _chunk(self, remaining: int, budget: int) -> int:
        """Tokens to run for a sequence with `remaining` uncomputed tokens (chunked prefill)."""
        n = min(remaining, budget)
        if self.prefill_chunk_size is not None:
            n = min(n, self.prefill_chunk_size)
        return n

    def _preempt(self, seq: Sequence, batch: ScheduledBatch) -> None:
        self.running.remove(seq)
        self.kv.free(seq)
        seq.status = SeqStatus.WAITING
        seq.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(seq)
        batch.preempted.append(seq)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = self._chunk(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self.kv.can_append(seq, n):
                victim = self.running[-1]
                self._preempt(victim, batch)
                if victim is seq:
                    break
            if seq.status is not SeqStatus.RUNNING:
                break  # it was the newest and gave up its own blocks
            self.kv.append(seq, n)
            batch.add(seq, n)
            budget -= n
            i += 1

        if batch.preempted:
            return batch  # memory is short: admit nothing new this step
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            cached = self.kv.find_cached_prefix(seq)
            n = self._chunk(seq.num_tokens - len(cached) * self.kv.block_size, budget)
            if not self.kv.can_allocate(seq, cached, n):
                break
            self.waiting.popleft()
            self.kv.allocate(seq, cached, n)
            if seq.preemptions == 0 and seq.num_output_tokens == 0:
                seq.num_cached_tokens = seq.num_computed_tokens
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            batch.add(seq, n)
            budget -= n
        return batch
