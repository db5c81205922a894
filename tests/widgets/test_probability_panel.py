"""The probability panel shows exactly the snapshot's numbers for the selected token."""

from __future__ import annotations

import numpy as np
import pytest
from hand_events import finished, snapshot, token

from engine.config import SamplingParams
from engine.events import RequestStarted
from live.state import LiveState
from widgets.probability_panel import ProbabilityPanel
from widgets.probability_rows import cut_lines, entropy_text
from widgets.token_text import visible
from widgets.what_if_state import WHAT_IF_HOW, WHAT_IF_LABEL, WHAT_IF_STREAMING, WHAT_IF_WAITING

TEXTS = [" the", " a", "\n", " an", "\tthis", " my"]
LOGITS = [3.0, 2.2, 1.9, 1.0, 0.4, -0.5]


def make_snap(drawn=1, **stages):
    return snapshot(LOGITS, TEXTS, drawn=drawn, **stages)


@pytest.fixture
def state():
    state = LiveState()
    state.apply([RequestStarted(1, 4, t=0.0)])
    return state


@pytest.fixture
def panel(qtbot, state):
    panel = ProbabilityPanel(state)
    qtbot.addWidget(panel)
    panel.resize(400, 300)
    return panel


def bars(panel):
    return [row.prob for row in panel.rows], [row.raw_prob for row in panel.rows]


def test_follows_the_latest_token_and_shows_its_final_stage(panel, state):
    first, second = make_snap(drawn=0, temperature=0.7), make_snap(drawn=2, temperature=1.3, top_k=3)
    panel.refresh(state.apply([token(1, 0, 0.1, " the", first)]))
    assert bars(panel) == (list(first.stages[-1].probs), list(first.stages[0].probs))
    panel.refresh(state.apply([token(1, 1, 0.2, "\n", second)]))
    assert panel.stage_name == "top_k"
    probs, raw = bars(panel)
    assert probs == list(second.stages[-1].probs) and raw == list(second.stages[0].probs)
    assert [row.drawn for row in panel.rows] == [cid == 2 for cid in second.candidate_ids]
    assert "token 1" in panel.header.text() and "(latest)" in panel.header.text()


def test_every_stage_can_be_selected_and_its_bars_match(panel, state):
    snap = make_snap(temperature=0.8, top_k=4, top_p=0.8)
    panel.refresh(state.apply([token(1, 0, 0.1, " a", snap)]))
    assert [b.property("stage") for b in panel.stage_buttons.buttons()] == [s.name for s in snap.stages]
    for i, stage in enumerate(snap.stages):
        panel.stage_buttons.button(i).click()
        assert panel.stage_name == stage.name
        assert bars(panel)[0] == list(stage.probs)
        removed_so_far = [any(s.removed[j] for s in snap.stages[: i + 1]) for j in range(len(TEXTS))]
        assert [row.removed_by is not None for row in panel.rows] == removed_so_far


def test_cuts_are_marked_where_each_stage_starts_removing(panel, state):
    snap = make_snap(top_k=4, top_p=0.8)
    panel.refresh(state.apply([token(1, 0, 0.1, " the", snap)]))
    top_k = [s.name for s in snap.stages].index("top_k")
    top_p_removed = snap.stages[top_k + 1].removed.index(True)
    assert cut_lines(panel.rows) == [(top_p_removed, "top_p"), (4, "top_k")]
    assert panel.summary.text().startswith("top-p: keeps")


def test_pinned_token_stays_while_new_tokens_arrive(panel, state):
    old, new = make_snap(drawn=0), make_snap(drawn=3, temperature=2.0)
    state.apply([token(1, 0, 0.1, " the", old)])
    panel.show_token(1, 0)
    panel.refresh(state.apply([token(1, 1, 0.2, " an", new)]))
    assert bars(panel)[0] == list(old.stages[-1].probs)
    assert "(selected)" in panel.header.text()
    panel.show_token(None, None)
    assert bars(panel)[0] == list(new.stages[-1].probs)


def test_pinned_token_not_yet_generated_appears_when_it_arrives(panel, state):
    panel.show_token(1, 0)
    assert panel.rows == [] and panel.bars.message
    snap = make_snap()
    panel.refresh(state.apply([token(1, 0, 0.1, " a", snap)]))
    assert bars(panel)[0] == list(snap.stages[-1].probs)


def test_what_if_asks_the_shell_then_shows_its_recomputation_clearly_labelled(panel, state, qtbot):
    snap = make_snap(drawn=0, temperature=1.0)
    panel.refresh(state.apply([token(1, 0, 0.1, " the", snap)]))
    panel.show_token(1, 0)
    params = SamplingParams(temperature=0.5, top_k=2)
    with qtbot.waitSignal(panel.what_if_requested) as asked:
        panel.set_what_if(params)
    assert asked.args == [1, 0, params]
    # Until the answer comes the recorded bars stay, and the banner says it is being recomputed.
    assert panel.banner.isVisibleTo(panel) and panel.banner.text().startswith(WHAT_IF_LABEL)
    assert WHAT_IF_WAITING in panel.banner.text() and bars(panel)[0] == list(snap.stages[-1].probs)
    recomputed = make_snap(drawn=0, temperature=0.5, top_k=2)
    panel.show_what_if(1, 0, params, recomputed)
    assert "top-k 2" in panel.banner.text() and WHAT_IF_HOW in panel.banner.text()
    assert [s.name for s in panel.stages] == [s.name for s in recomputed.stages]
    assert bars(panel)[0] == list(recomputed.stages[-1].probs)
    assert "would be" in panel.header.text()
    with qtbot.assertNotEmitted(panel.what_if_requested):
        panel.select_stage("raw")  # an answered what-if is not asked again
    panel.set_what_if(None)
    assert not panel.banner.isVisibleTo(panel)
    assert bars(panel)[0] == list(snap.stages[-1].probs)


def test_a_what_if_that_cannot_be_recomputed_says_why(panel, state, qtbot):
    snap = make_snap(drawn=0)
    panel.refresh(state.apply([token(1, 0, 0.1, " the", snap)]))
    panel.show_token(1, 0)
    params = SamplingParams(temperature=0.5)
    panel.set_what_if(params)
    panel.show_what_if(1, 0, SamplingParams(temperature=0.9), make_snap(drawn=0))  # a stale answer
    assert WHAT_IF_WAITING in panel.banner.text()
    panel.show_what_if(1, 0, params, None, "this token's request is no longer known to the engine")
    assert panel.rows == [] and "no longer known" in panel.bars.message


def test_what_if_while_following_a_streaming_reply_waits_for_its_end(panel, state, qtbot):
    snap = make_snap(drawn=0)
    panel.refresh(state.apply([token(1, 0, 0.1, " the", snap)]))
    params = SamplingParams(temperature=0.5)
    with qtbot.assertNotEmitted(panel.what_if_requested):
        panel.set_what_if(params)  # following the reply as it streams: no forward per token
    assert WHAT_IF_STREAMING in panel.banner.text() and bars(panel)[0] == list(snap.stages[-1].probs)
    with qtbot.waitSignal(panel.what_if_requested) as asked:
        panel.refresh(state.apply([finished(1, "stop", 0.1, (), t=0.3)]))
    assert asked.args == [1, 0, params]


def test_token_without_snapshot_explains_how_to_record_one(panel, state):
    panel.refresh(state.apply([token(1, 0, 0.1, " x")]))
    assert panel.rows == []
    assert "snapshot size" in panel.bars.message


def test_token_texts_show_whitespace(panel, state):
    panel.refresh(state.apply([token(1, 0, 0.1, " the", make_snap())]))
    texts = {row.token_id: row.text for row in panel.rows}
    assert texts[0] == "␣the" and texts[2] == "⏎" and texts[4] == "⇥this"
    assert visible("") == "∅" and visible("a\x01") == "a\\x01"


def test_tooltip_lists_every_stage(panel, state):
    snap = make_snap(top_k=2)
    panel.refresh(state.apply([token(1, 0, 0.1, " a", snap)]))
    tip = panel.bars.tooltip_for(len(panel.rows) - 1)
    assert "raw:" in tip and "temperature:" in tip and "top-k:" in tip and "removed by top-k" in tip


def test_entropy_is_exact_when_candidates_hold_all_mass_and_a_bound_otherwise():
    snap = make_snap(top_k=3)
    probs = np.array([p for p in snap.stages[-1].probs if p > 0])
    assert entropy_text(snap.stages[-1]) == f"{-(probs * np.log(probs)).sum():.2f} nats"
    partial = snap.stages[-1].__class__("x", (0.5, 0.2), (False, False), 10, 1.0)
    assert entropy_text(partial).startswith("≥")


def test_renders_readably_at_400_by_300(panel, state):
    panel.refresh(state.apply([token(1, 0, 0.1, " a", make_snap(top_k=4))]))
    panel.show()
    image = panel.grab().toImage()
    assert (image.width(), image.height()) == (400, 300)
    assert panel.bars.visible_row_count() == len(TEXTS)  # every candidate fits at this size


def grammar_snap():
    """A token under a grammar: raw, the mask (2 of 6 allowed), then temperature."""
    from engine.events import GrammarSnapshot, StageSnapshot, TokenSnapshot

    raw = np.exp(LOGITS) / np.exp(LOGITS).sum()
    allowed = np.array([False, True, False, True, False, False])
    masked = np.where(allowed, raw, 0.0) / raw[allowed].sum()
    stages = (
        StageSnapshot("raw", tuple(raw), (False,) * 6, 6, 1.0),
        StageSnapshot("grammar", tuple(masked), tuple(~allowed), 2, float(raw[allowed].sum())),
        StageSnapshot("temperature", tuple(masked), (False,) * 6, 2, 1.0),
    )
    grammar = GrammarSnapshot(
        allowed=2,
        vocab_size=6,
        removed_mass=float(1 - raw[allowed].sum()),
        forced=False,
        accepting=True,
        forced_ids=(),
        cut_ids=(0, 2),
        cut_texts=(" the", "\n"),
        cut_probs=(float(raw[0]), float(raw[2])),
    )
    return TokenSnapshot(
        candidate_ids=tuple(range(6)),
        candidate_texts=tuple(TEXTS),
        stages=stages,
        drawn_id=1,
        drawn_prob=float(masked[1]),
        entropy=0.5,
        raw_entropy=1.5,
        grammar=grammar,
    )


def test_the_grammar_mask_is_a_stage_like_the_others(panel, state):
    snap = grammar_snap()
    panel.refresh(state.apply([token(1, 0, 0.1, " a", snap)]))
    assert [b.text() for b in panel.stage_buttons.buttons()] == ["raw", "grammar", "temperature"]
    panel.select_stage("grammar")
    assert bars(panel)[0] == list(snap.stages[1].probs)
    assert [row.removed_by for row in panel.rows] == ["grammar", None, "grammar", None, "grammar", "grammar"]
    removed = snap.grammar.removed_mass
    assert (
        panel.summary.text()
        == f"grammar: 2 of 6 tokens allowed, {removed * 100:.0f}% of the raw mass removed"
    )
    note = panel.grammar_note.text()
    assert not panel.grammar_note.isHidden()
    # with the grammar stage shown its counts are the summary; the line says what else it did
    assert note.startswith("grammar: the text is complete here") and "cut: ‹␣the› 49.5%, ‹⏎› 16.5%" in note
    panel.select_stage(None)  # the final stage: the line carries the grammar's counts too
    assert panel.grammar_note.text().startswith("grammar: 2 of 6 tokens allowed")
    # a token without a grammar hides the line
    panel.refresh(state.apply([token(1, 1, 0.2, " a", make_snap())]))
    assert panel.grammar_note.isHidden()


def test_a_share_never_rounds_to_all_or_nothing_when_it_is_neither():
    from widgets.probability_rows import share_text

    assert [share_text(s) for s in (0.0, 0.00001, 0.003, 0.05, 0.41, 0.9998, 0.99999, 1.0)] == [
        "0.00%",
        "< 0.01%",
        "0.30%",
        "5.0%",
        "41%",
        "99.98%",
        "> 99.99%",
        "100.00%",
    ]
