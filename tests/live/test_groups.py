"""The live state's fold of group requests from hand-made events: forks sharing blocks and a
copy-on-write copy taking its source's place in the page map, the group's block count, the
samples' names, and each beam step as a latency point."""

from __future__ import annotations

import pytest
from hand_events import FORK_A, FORK_B, beam_events, beam_step, fork_events, loaded_state

from engine.events import RequestStarted
from live.groups import group_blocks


@pytest.fixture
def state():
    return loaded_state()


def test_forks_share_blocks_and_a_copy_on_write_copy_takes_the_source_place(state):
    dirty = state.apply(fork_events())
    pm = state.page_map
    assert not state.errors and "groups" in dirty
    assert list(pm.ref_count[:3]) == [3, 2, 1]  # the source keeps its other two owners
    assert pm.owners[1] == [1, FORK_B] and pm.owners[2] == [FORK_A]
    assert (pm.fill[2], pm.token_start[2], pm.copied_from[2]) == (3, 4, 1)
    group = state.groups[1]
    assert (group.forks, group.cow_copies, group.kind) == (2, 1, "samples")
    assert group.sample_text == {1: " blue"} and state.requests[1].tokens == []  # sample 0 only there
    assert group_blocks(pm, group.live_seqs) == group.blocks(pm)
    assert (group.blocks(pm).shared, group.blocks(pm).unshared) == (3, 6)
    assert state.seq_label(FORK_A) == "#1 sample 2" and state.seq_label(1) == "#1 sample 1"


def test_each_beam_step_is_a_latency_point_with_the_first_as_ttft(state):
    events = beam_events()
    started = RequestStarted(5, 4, t=10.0)
    steps = [
        beam_step(5, i, e.parents, e.token_texts, e.scores, e.seq_ids, t=10.5 + 0.25 * i)
        for i, e in enumerate(e for e in events if type(e).__name__ == "BeamStep")
    ]
    state.apply([started, *steps])
    assert list(state.latency.column("latency_ms")) == pytest.approx([500.0, 250.0, 250.0])
    assert list(state.latency.column("is_first")) == [1.0, 0.0, 0.0]
    assert state.requests[5].first_token_row == 0
