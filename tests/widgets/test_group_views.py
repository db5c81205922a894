"""Group requests drawn from hand-made events: the group's saving line, the page map's names for
the samples, the beam tree and the samples' columns (the fold itself: tests/live/test_groups.py)."""

from __future__ import annotations

import pytest
from hand_events import FORK_A, FORK_B, beam_events, fork_events, loaded_state

from app.chat.group_reply import Alternative, GroupReply
from app.chat.group_reply_view import GroupReplyCard
from engine.events import (
    BlockEvent,
    GroupStats,
    RequestFinished,
    RequestStats,
    SequenceFinished,
    SequenceResult,
)
from widgets.beam_tree import BeamTreeView, beam_nodes, format_score
from widgets.kv_page_map import KVPageMapPanel, group_lines


@pytest.fixture
def state():
    return loaded_state()


def test_ended_forks_free_their_blocks_and_the_line_reports_the_engine_figures(state):
    state.apply(fork_events())
    end = [
        SequenceFinished(1, FORK_A, 1, "length"),
        BlockEvent("free", (2, 0), FORK_A),
        SequenceFinished(1, FORK_B, 2, "length"),
        BlockEvent("free", (1, 0), FORK_B),
        BlockEvent("free", (1, 0), 1),
    ]
    state.apply(end)
    pm = state.page_map
    assert pm.used_blocks == 0 and int(pm.copied_from.max()) == -1 and not state.errors
    stats = RequestStats(6, 3, 0, 0.1, (), 10.0, 0, 3)
    group = GroupStats("samples", 3, 3, 6, 1, forks=2)
    results = tuple(SequenceResult(b, "x", (1,), -0.5 * (b + 1), "length") for b in range(3))
    state.apply([RequestFinished(1, "length", "x", (1,), stats, 0.0, results, group)])
    assert group_lines(state, pm) == [
        "group #1 (3 samples, peak): 3 blocks shared vs 6 unshared (saving 50%), 1 copy-on-write"
    ]


def test_the_page_map_panel_names_the_samples_and_shows_the_saving(qtbot, state):
    panel = KVPageMapPanel(state)
    qtbot.addWidget(panel)
    panel.resize(420, 300)
    panel.show()
    panel.refresh(state.apply(fork_events()))
    legend = panel.legend.text().replace("&nbsp;", " ")
    assert "request #1 · 3 samples" in legend and "copy-on-write copy" in legend
    assert legend.count("■") == 2 + 2  # free, cached; then the two sequences owning blocks
    assert panel.group_line.text() == (
        "group #1 (3 samples, now): 3 blocks shared vs 6 unshared (saving 50%), 1 copy-on-write"
    )
    tip = panel.canvas.describe(2)
    assert "request #1 sample 2" in tip and "copy-on-write copy of block 1" in tip
    assert "shared by requests #1 sample 1, #1 sample 3" in panel.canvas.describe(1)


def test_beam_nodes_follow_the_steps_and_fade_the_dropped_branch(state):
    state.apply(beam_events())
    nodes = beam_nodes(state.groups[5].beam_steps)
    slots = [(n.step, n.row, n.parent_row, n.text, n.alive) for n in nodes if not n.finished]
    assert slots == [
        (0, 0, -1, " a", True),
        (0, 1, -1, " b", False),  # nothing later extends beam 2 of step 0
        (1, 0, 0, "\n", True),
        (1, 1, 0, " c", True),
        (2, 0, 0, " d", True),
        (2, 1, 1, " e", False),  # no candidate when the search ended (the -1e9 sentinel)
    ]
    (end,) = [n for n in nodes if n.finished]
    # Its last token (id 2) was chosen by no slot, so it is named by id.
    assert (end.step, end.row, end.parent_row, end.text, end.score) == (2, 2, 1, "id 2", -0.45)
    assert format_score(-1e9) == "–" and format_score(-0.45) == "-0.45"
    assert state.groups[5].kind == "beams" and state.seq_label(10) == "#5 beam 2"


def test_beam_tree_view_grows_with_each_step(qtbot, state):
    view = BeamTreeView(state, 5)
    qtbot.addWidget(view)
    events = beam_events()
    state.apply(events[:3])
    view.refresh({"groups"})
    assert len(view.nodes) == 2
    narrow = view.width()
    state.apply(events[3:])
    view.refresh({"groups"})
    assert len(view.nodes) == 2 + 2 + 2 + 1 and view.width() > narrow
    node = view.node_at(*view.node_rect(1, 1).center().toTuple())
    assert node.text == " c" and "running score -0.90" in view.describe(node)
    assert not view.grab().isNull()


def test_sample_columns_stream_then_show_results_and_the_kept_one(qtbot, state):
    state.apply(fork_events())
    card = GroupReplyCard("tiny", 1, "samples", 3, state)
    qtbot.addWidget(card)
    card.refresh({"groups"})
    assert "■" in card.cards[1]._title.text()  # sample 2's swatch: its sequence's page-map colour
    card.set_sample_text(1, " blue", 1)
    assert card.cards[1].text == " blue" and not card.cards[1].keep_button.isEnabled()
    reply = GroupReply(
        "samples",
        [Alternative(b, f"text {b}", -1.0 - b, "length", 3) for b in range(3)],
        kept=0,
    )
    card.show_results(reply)
    card.set_keep_enabled(True)
    assert card.text == "text 0" and card.cards[0].kept and not card.cards[0].keep_button.isEnabled()
    assert "log p -2.00" in card.cards[1]._facts.text()
    with qtbot.waitSignal(card.keep_requested) as kept:
        card.cards[2].keep_button.click()
    assert kept.args == [2]
    card.set_kept(2)
    assert card.text == "text 2" and card.cards[2].kept and not card.cards[0].kept
    assert GroupReply.from_meta(card.reply.to_meta()) == card.reply
