"""A request's state inside the engine: its tokens, how many are in the KV cache, its blocks."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.config import SamplingParams

if TYPE_CHECKING:
    import torch

    from engine.core.detokenize import IncrementalDetokenizer
    from engine.core.seq_group import SequenceGroup
    from engine.kv.block_pool import Block
    from engine.sampling.sampler import Sampler


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    seq_id: int
    token_ids: list[int]  # prompt followed by generated tokens
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
    # Speculative decoding: draft tokens appended to token_ids for the current round (not yet
    # verified), their draft distributions, the round size and the running record.
    num_draft_tokens: int = 0
    draft_q: list[torch.Tensor | None] = field(default_factory=list)  # None: a one-hot proposal
    draft_k: int = 0
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
        return len(self.token_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_prefill(self) -> bool:
        """Still has more than the newest token to put in the cache."""
        uncomputed = self.num_tokens - self.num_draft_tokens - self.num_computed_tokens
        return uncomputed > 1 or self.num_output_tokens - self.num_draft_tokens == 0

    def drop_drafts(self, keep: int = 0) -> None:
        """Remove unverified draft tokens beyond the first `keep`."""
        extra = self.num_draft_tokens - keep
        if extra > 0:
            del self.token_ids[-extra:]
            del self.draft_q[keep:]
            self.num_draft_tokens = keep
