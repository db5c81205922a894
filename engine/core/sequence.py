"""A request's state inside the engine: its tokens, how many are in the KV cache, its blocks; and
the group of sequences a request runs when it asks for several at once (n samples, beams).

A group starts as one sequence (its id is the request id) that prefills the prompt. Samples
fork from it once the prompt is in the cache; beams re-fork from their parents at every step.
A fork is a new `Sequence` with the same tokens that shares every block of its parent (ref
count + 1); the KV manager copies a shared block only when a sequence writes into it.

The scheduler treats the group as a unit: its sequences sit together in the running queue, are
preempted and re-admitted together, and (beams) run their forwards in lockstep.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from engine.config import SamplingParams
from engine.core.beam_search import BeamSearch
from engine.events import GroupStats
from engine.kv.manager import KVCacheManager

if TYPE_CHECKING:
    import torch

    from engine.grammar.state import GrammarState
    from engine.kv.block_pool import Block
    from engine.sampling.sampler import Sampler
    from engine.text.detokenize import IncrementalDetokenizer
    from engine.tools.use import ToolUse


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    seq_id: int
    token_ids: list[int]  # prompt followed by generated tokens: committed ones, never a draft
    num_prompt_tokens: int
    params: SamplingParams
    status: SeqStatus = SeqStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    block_table: list[Block] = field(default_factory=list)  # in order
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    preemptions: int = 0
    peak_blocks: int = 0
    arrival_time: float = field(default_factory=time.perf_counter)
    first_scheduled_time: float | None = None  # when a step first ran it (its prefill began)
    # One time per engine step that gave it tokens (a speculative round's tokens share one)
    token_times: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    target_forwards: int = 0  # engine steps that ran this sequence through the model
    # Speculative decoding: the current round's draft tokens, kept apart from token_ids until the
    # verifier decides (vLLM's spec_token_ids; the scheduler and the runner count and compute them
    # after the committed tokens), their draft distributions, the draft length the round was
    # given and its share of the drafting time, and the record (the saving measured per round).
    spec_token_ids: list[int] = field(default_factory=list)
    draft_q: list[torch.Tensor | None] = field(default_factory=list)  # None: a one-hot proposal
    draft_length: int = 0
    draft_s: float = 0.0
    spec_saved_s: float = 0.0
    spec_rounds: int = 0
    spec_drafted: int = 0
    spec_accepted: int = 0
    spec_accepted_by_position: list[int] = field(default_factory=list)
    spec_drafted_by_position: list[int] = field(default_factory=list)
    # Set by the engine when it admits the request (see the properties below).
    _sampler: Sampler | None = field(default=None, repr=False)
    _detokenizer: IncrementalDetokenizer | None = field(default=None, repr=False)
    # n samples / beam search: the group it belongs to (None for a plain request), its sample
    # index or beam slot, its drawn tokens' summed log-probs, and the shared blocks it copied
    # before writing into them.
    group: SequenceGroup | None = None
    branch: int = 0
    cumulative_logprob: float = 0.0
    cow_copies: int = 0
    # Constrained decoding: where the sequence is in its grammar (None without one). It holds
    # exactly the generated tokens (and a branch's reply prefix); `grammar_dead_end` says why a
    # beam can no longer go on under it.
    grammar: GrammarState | None = None
    grammar_dead_end: str = ""
    # A request that offered tools: how its reply is read for calls when it ends.
    tool_use: ToolUse | None = None
    # False: no text made on the engine thread (Request.detokenize), for it and its forks
    makes_text: bool = True
    # The prefix-cache keys of its full blocks, each with the tokens it was computed from
    # (engine.kv.manager: computed once per block, not once per commit).
    block_keys: list[tuple[tuple[int, ...], bytes]] = field(default_factory=list, repr=False)

    @property
    def sampler(self) -> Sampler:
        assert self._sampler is not None, "the engine gives a sequence its sampler when it admits it"
        return self._sampler

    @sampler.setter
    def sampler(self, sampler: Sampler) -> None:
        self._sampler = sampler

    @property
    def detokenizer(self) -> IncrementalDetokenizer:
        assert self._detokenizer is not None, "the engine gives a sequence its detokenizer when it admits it"
        return self._detokenizer

    @detokenizer.setter
    def detokenizer(self, detokenizer: IncrementalDetokenizer) -> None:
        self._detokenizer = detokenizer

    @property
    def num_tokens(self) -> int:
        """Committed tokens (prompt and output; no draft)."""
        return len(self.token_ids)

    @property
    def num_draft_tokens(self) -> int:
        return len(self.spec_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        """What the scheduler counts: the committed tokens and the round's drafts after them."""
        return len(self.token_ids) + len(self.spec_token_ids)

    def tokens_with_spec(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of the committed tokens followed by the drafts: what a forward
        computes at those positions."""
        committed = self.token_ids
        if end <= len(committed):
            return committed[start:end]
        return (committed + self.spec_token_ids)[start:end]

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_prefill(self) -> bool:
        """Still has more than the newest token to put in the cache."""
        uncomputed = self.num_tokens - self.num_computed_tokens
        return uncomputed > 1 or self.num_output_tokens == 0

    def drop_drafts(self, keep: int = 0) -> None:
        """Remove unverified draft tokens beyond the first `keep`."""
        del self.spec_token_ids[keep:]
        del self.draft_q[keep:]


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
        self.note = ""  # why it ended, when the reason needs words (a grammar's dead end)
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
