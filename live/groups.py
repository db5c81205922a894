"""What the GUI knows about a request that runs several sequences: n samples or a beam search.

`LiveState` folds the group events (SequenceForked, SequenceFinished, BeamStep, the branch of
each TokenGenerated, "cow" block events) into one `GroupView` per request. The chat reads the
samples' streamed text and the beam steps from it; the page map reads which sequences belong
to which request (to name and count them) and the group's block figures.

The group's memory is read from the page map as the engine would count it: the distinct blocks
its sequences hold against the sum of their block tables (what private copies would need).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from engine.events import BeamStep, GroupStats, RequestFinished, TokenGenerated
from live.page_map import PageMap


@dataclass(frozen=True, slots=True)
class GroupBlocks:
    """A group's KV blocks at one moment: with sharing, and as private copies would need."""

    shared: int  # distinct blocks its sequences hold
    unshared: int  # the sum of its sequences' block-table lengths

    @property
    def saving(self) -> float:
        return 1.0 - self.shared / self.unshared if self.unshared else 0.0


@dataclass(slots=True)
class GroupView:
    """One n-sample or beam-search request as far as its events have arrived."""

    request_id: int
    kind: str = ""  # "samples" | "beams", once an event has told which
    # Every sequence the group has run -> its sample index (samples) or latest beam slot (beams).
    # The request's own sequence (seq_id == request_id) is branch 0 from the start.
    branch_of: dict[int, int] = field(default_factory=dict)
    live_seqs: set[int] = field(default_factory=set)  # holding blocks now
    ended: dict[int, str] = field(default_factory=dict)  # seq id -> SequenceFinished reason
    sample_text: dict[int, str] = field(default_factory=dict)  # sample index -> text so far
    sample_tokens: dict[int, int] = field(default_factory=dict)  # sample index -> tokens so far
    beam_steps: list[BeamStep] = field(default_factory=list)
    forks: int = 0
    cow_copies: int = 0
    finished: RequestFinished | None = None

    def __post_init__(self) -> None:
        self.branch_of.setdefault(self.request_id, 0)
        self.live_seqs.add(self.request_id)

    @property
    def is_group(self) -> bool:
        """True once the request is known to run more than one sequence."""
        return bool(self.kind) or self.forks > 0

    @property
    def done(self) -> bool:
        return self.finished is not None

    @property
    def stats(self) -> GroupStats | None:
        return self.finished.group if self.finished is not None else None

    def seq_of_branch(self, branch: int) -> int | None:
        """The sequence now holding a sample (or beam slot); None before it is forked."""
        for seq_id, b in self.branch_of.items():
            if b == branch and (seq_id in self.live_seqs or self.kind == "samples"):
                return seq_id
        return None

    # ---- folding ---------------------------------------------------------------------------
    def on_fork(self, parent_seq_id: int, seq_id: int, branch: int) -> None:
        self.branch_of[seq_id] = branch
        self.live_seqs.add(seq_id)
        self.forks += 1

    def on_sequence_finished(self, seq_id: int, reason: str) -> None:
        self.ended[seq_id] = reason
        self.live_seqs.discard(seq_id)
        if reason == "pruned":
            self.kind = "beams"

    def on_token(self, event: TokenGenerated) -> None:
        if event.branch > 0:
            self.kind = "samples"
        self.sample_text[event.branch] = self.sample_text.get(event.branch, "") + event.text_delta
        self.sample_tokens[event.branch] = self.sample_tokens.get(event.branch, 0) + 1

    def on_beam_step(self, event: BeamStep) -> None:
        self.kind = "beams"
        self.beam_steps.append(event)
        for slot, seq_id in enumerate(event.seq_ids):
            self.branch_of[seq_id] = slot

    def on_finished(self, event: RequestFinished) -> None:
        self.finished = event
        if event.group is not None:
            self.kind = event.group.kind
        self.live_seqs.clear()

    # ---- memory ----------------------------------------------------------------------------
    def blocks(self, page_map: PageMap) -> GroupBlocks:
        """The group's blocks now, counted from the page map's owners (exact from block events)."""
        return group_blocks(page_map, self.live_seqs)


def group_blocks(page_map: PageMap, seq_ids: set[int]) -> GroupBlocks:
    """Distinct blocks held by `seq_ids` and the sum of their references (their table lengths)."""
    shared = unshared = 0
    if not seq_ids:
        return GroupBlocks(0, 0)
    for block in np.flatnonzero(page_map.ref_count > 0):
        holders = sum(1 for owner in page_map.owners[block] if owner in seq_ids)
        if holders:
            shared += 1
            unshared += holders
    return GroupBlocks(shared, unshared)


def saving_line(view: GroupView, page_map: PageMap) -> str:
    """The group's memory in one line: its final peaks (GroupStats) once it ended, else now."""
    noun = "samples" if view.kind == "samples" else "beams" if view.kind == "beams" else "sequences"
    stats = view.stats
    if stats is not None:
        size = stats.num_sequences
        shared, unshared, cows = stats.shared_blocks, stats.unshared_blocks_equivalent, stats.cow_copies
        saving, when = stats.saving, "peak"
    else:
        now = view.blocks(page_map)
        size = len(view.live_seqs)
        shared, unshared, cows, saving, when = now.shared, now.unshared, view.cow_copies, now.saving, "now"
    return (
        f"group #{view.request_id} ({size} {noun}, {when}): {shared} blocks shared vs "
        f"{unshared} unshared (saving {saving * 100:.0f}%), {cows} copy-on-write"
    )
