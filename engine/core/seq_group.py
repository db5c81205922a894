"""A request that runs several sequences at once: n parallel samples, or the beams of a search.

The group starts as one sequence (its id is the request id) that prefills the prompt. Samples
fork from it once the prompt is in the cache; beams re-fork from their parents at every step.
A fork is a new `Sequence` with the same tokens that shares every block of its parent (ref
count + 1); the KV manager copies a shared block only when a sequence writes into it.

The scheduler treats the group as a unit: its sequences sit together in the running queue, are
preempted and re-admitted together, and (beams) run their forwards in lockstep.
"""

from __future__ import annotations

from dataclasses import replace

from engine.config import SamplingParams
from engine.core.beam_search import BeamSearch
from engine.core.sequence import Sequence
from engine.events import GroupStats
from engine.kv.manager import KVCacheManager


class SequenceGroup:
    def __init__(self, request_id: int, params: SamplingParams, first: Sequence, beam: BeamSearch | None):
        self.request_id = request_id
        self.params = params
        self.kind = "beams" if params.beam_search else "samples"
        self.size = params.group_size
        self.beam = beam
        self.members: list[Sequence] = [first]  # live sequences, by branch (samples) or slot (beams)
        self.ended: list[Sequence] = []  # samples that finished before the request did
        self.every_seq: list[Sequence] = [first]  # for the copy-on-write total
        self.forked = False  # samples: the prompt's sequence has been forked n ways
        self.forks = 0
        self.pruned = 0
        self.preemptions = 0
        self.peak_shared = 0
        self.peak_unshared = 0
        self.token_times: list[float] = []
        self._last_token_step = -1
        first.group = self

    @property
    def search(self) -> BeamSearch:
        """A beam group's search (samples have none)."""
        assert self.beam is not None, "only a beam group has a search"
        return self.beam

    @property
    def lockstep(self) -> bool:
        """Beams must all get their logits in the same step (the search ranks them together)."""
        return self.kind == "beams" and len(self.members) > 1

    @property
    def seats(self) -> int:
        """Places in the running batch the group takes or will take (max_num_seqs)."""
        if self.kind == "samples" and self.forked:
            return len(self.members)  # a finished sample gives its place back
        return self.size

    @property
    def cow_copies(self) -> int:
        return sum(seq.cow_copies for seq in self.every_seq)

    def fork(self, parent: Sequence, seq_id: int, branch: int, kv: KVCacheManager) -> Sequence:
        """A new member with the parent's tokens, sharing all its blocks."""
        child = Sequence(
            seq_id,
            list(parent.token_ids),
            parent.num_prompt_tokens,
            parent.params,
            status=parent.status,
            num_cached_tokens=parent.num_cached_tokens,
            arrival_time=parent.arrival_time,
            first_scheduled_time=parent.first_scheduled_time,
            group=self,
            branch=branch,
            cumulative_logprob=parent.cumulative_logprob,
            makes_text=parent.makes_text,
        )
        kv.share(parent, child)
        self.every_seq.append(child)
        self.forks += 1
        return child

    def sample_params(self, branch: int) -> SamplingParams:
        """Sample i draws with its own generator, seeded seed + i when a seed is given."""
        if self.params.seed is None:
            return self.params
        return replace(self.params, seed=self.params.seed + branch)

    def measure_blocks(self) -> None:
        """Update the peaks of distinct blocks held vs blocks the members would hold unshared."""
        distinct = {block.block_id for seq in self.members for block in seq.block_table}
        self.peak_shared = max(self.peak_shared, len(distinct))
        self.peak_unshared = max(self.peak_unshared, sum(len(seq.block_table) for seq in self.members))

    def mark_token_step(self, step: int, now: float) -> None:
        """One time per engine step that gave the group tokens (its TTFT and inter-token gaps)."""
        if step != self._last_token_step:
            self._last_token_step = step
            self.token_times.append(now)

    def stats(self) -> GroupStats:
        return GroupStats(
            kind=self.kind,
            num_sequences=self.size,
            shared_blocks=self.peak_shared,
            unshared_blocks_equivalent=self.peak_unshared,
            cow_copies=self.cow_copies,
            forks=self.forks,
            pruned=self.pruned,
        )
