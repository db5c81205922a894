"""'Continue from here' in the probability panel: a click chooses any candidate of the shown
token (drawn or not), the button names it and asks for a branch there; another token clears it."""

from __future__ import annotations

from hand_events import snapshot, token
from PySide6.QtCore import QPointF, Qt

from engine.events import RequestStarted
from live.state import LiveState
from widgets.probability_panel import CONTINUE_HINT, ProbabilityPanel

TEXTS = [" the", " a", "\n", " an"]
LOGITS = [3.0, 2.2, 1.9, 1.0]


def make_panel(qtbot):
    state = LiveState()
    state.apply([RequestStarted(1, 4, t=0.0)])
    state.apply([token(1, i, t=0.1 * (i + 1), snap=snapshot(LOGITS, TEXTS, drawn=0)) for i in range(3)])
    panel = ProbabilityPanel(state)
    qtbot.addWidget(panel)
    panel.resize(400, 300)
    panel.show()
    panel.show_token(1, 2)
    return panel


def test_choosing_a_candidate_asks_to_continue_from_it(qtbot):
    panel = make_panel(qtbot)
    assert not panel.continue_button.isEnabled() and panel.continue_hint.text() == CONTINUE_HINT
    row = next(i for i, r in enumerate(panel.rows) if not r.drawn)
    panel.choose_candidate(row)
    assert panel.bars.chosen_row == row and panel.continue_button.isEnabled()
    assert panel.continue_button.text() == f"↳ Continue with “{panel.rows[row].text}”"
    with qtbot.waitSignal(panel.continue_requested) as asked:
        panel.continue_button.click()
    assert asked.args == [1, 2, panel.rows[row].token_id]

    drawn = next(i for i, r in enumerate(panel.rows) if r.drawn)  # the drawn one may be chosen too
    y = panel.bars._top + drawn * panel.bars._row_px + panel.bars._row_px / 2
    with qtbot.waitSignal(panel.continue_requested) as asked:
        qtbot.mouseDClick(panel.bars, Qt.MouseButton.LeftButton, pos=QPointF(20, y).toPoint())
    assert asked.args == [1, 2, panel.rows[drawn].token_id]

    panel.show_token(1, 1)  # another token: its rows are other candidates
    assert panel.bars.chosen_row is None and not panel.continue_button.isEnabled()
    panel.show_token(None, None)
    assert panel.chosen_candidate() is None
