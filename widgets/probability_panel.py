"""Token probabilities: the selected token's candidates, raw and after each sampling stage.

Follows the latest generated token unless `show_token` pins one. A row of stage buttons picks
which stage the bars show (the final one by default); the raw distribution stays visible as
ghost outlines. With `set_what_if(params)` the panel asks (`what_if_requested`) for the token's
stages under those settings, which the shell recomputes exactly on the engine thread
(engine.core.what_if: the sampler's own stages over the full logits the token was drawn from,
kept or recomputed through the engine's paged forward) and hands back with `show_what_if`; a
banner says which. With
`set_reference_source`, the full-precision reference of a quality run is drawn as a tick on
each row where it exists.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (
    QButtonGroup,
    QHBoxLayout,
    QLabel,
    QPushButton,
    QToolButton,
    QVBoxLayout,
    QWidget,
)

from engine.config import SamplingParams
from engine.events import StageSnapshot, TokenGenerated, TokenSnapshot
from live.remote import is_remote_snapshot
from live.state import LiveState
from widgets import theme
from widgets.flow_row import FlowRow
from widgets.live_label import LiveLabel
from widgets.probability_bars import REFERENCE_COLOUR, ProbabilityBars, percent
from widgets.probability_rows import (
    BarRow,
    bar_rows,
    entropy_text,
    grammar_detail,
    stage_label,
    stage_summary,
)
from widgets.reference import ReferenceDistribution
from widgets.token_text import visible
from widgets.what_if_state import WHAT_IF_HOW, WhatIfState

CONTINUE_HINT = "Click a candidate, then continue the reply from it as a new branch"


class ProbabilityPanel(QWidget):
    what_if_requested = Signal(int, int, object)  # request id, token index, SamplingParams
    # (request id, token index, candidate token id): cut the reply there, put that token there
    # and generate on (the chat makes it a branch of the reply).
    continue_requested = Signal(int, int, int)

    def __init__(self, state: LiveState, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.state = state
        self._request_id: int | None = None
        self._index: int | None = None
        self.what_if = WhatIfState()
        self._stage_choice: str | None = None  # None: the last (final) stage
        self._shown: TokenGenerated | None = None
        self._stale = True
        self.stages: tuple[StageSnapshot, ...] = ()
        self.stage_name: str | None = None
        self.what_if_error: str | None = None
        # (request id, token index) -> the full-precision reference there, or None
        self._reference_source: Callable[[int, int], ReferenceDistribution | None] | None = None
        self.reference: ReferenceDistribution | None = None

        self.setObjectName("probabilityPanel")
        self.setStyleSheet(
            f"#probabilityPanel, #probabilityPanel QLabel {{ background: {theme.BACKGROUND}; color: {theme.TEXT}; }}"
            f"#probabilityPanel QToolButton {{ background: #23262d; color: {theme.TEXT}; border: 1px solid {theme.GRID};"
            " border-radius: 3px; padding: 1px 6px; }"
            f"#probabilityPanel QToolButton:checked {{ background: #2f4a6b; border-color: {theme.SERIES['stage']}; }}"
        )
        self.header = LiveLabel()
        self.header.setTextFormat(Qt.TextFormat.RichText)
        self.header.setWordWrap(True)
        self.banner = QLabel()
        self.banner.setStyleSheet(
            f"background: {theme.WHAT_IF}; color: #1a1a1a; padding: 2px 6px; font-weight: bold;"
        )
        self.banner.setWordWrap(True)
        self.banner.hide()
        # a row that wraps: with many stages it would otherwise hold the panel (and the window)
        # wider than a 960 px screen
        self.stage_row = QWidget()
        self.stage_bar = FlowRow(self.stage_row, spacing=3)
        self.stage_buttons = QButtonGroup(self)
        self.stage_buttons.setExclusive(True)
        self.stage_buttons.idClicked.connect(self._on_stage_clicked)
        self.summary = LiveLabel()
        self.summary.setStyleSheet(f"color: {theme.MUTED};")
        # Under a grammar: what its mask (the first stage) forced and cut at this token.
        self.grammar_note = QLabel()
        self.grammar_note.setWordWrap(True)
        self.grammar_note.setStyleSheet(f"color: {theme.TEXT};")
        self.grammar_note.hide()
        self.reference_note = QLabel()
        self.reference_note.setTextFormat(Qt.TextFormat.RichText)
        self.reference_note.setWordWrap(True)
        self.reference_note.hide()
        self.bars = ProbabilityBars()
        self.bars.row_clicked.connect(self._on_row_clicked)
        self.bars.row_double_clicked.connect(self._on_row_double_clicked)
        self.continue_button = QPushButton("↳ Continue from here")
        self.continue_button.setToolTip(
            "Cut the reply at this token, put the chosen candidate there and generate the rest with the "
            "current settings, as a new branch (the prefix's KV blocks come from the prefix cache)"
        )
        self.continue_button.clicked.connect(self._on_continue_clicked)
        # a line of its own above the button, as tall as its wrapped text (LiveLabel's least
        # height is its text's at this width): beside the button at a narrow width it wrapped to
        # four lines within a one-line row and was drawn over the bars
        self.continue_hint = LiveLabel(CONTINUE_HINT)
        self.continue_hint.setStyleSheet(f"color: {theme.MUTED};")
        self._chosen_for: tuple[int, int] | None = None  # the token the chosen row belongs to

        layout = QVBoxLayout(self)
        layout.setContentsMargins(6, 4, 6, 4)
        layout.setSpacing(3)
        layout.addWidget(self.header)
        layout.addWidget(self.banner)
        layout.addWidget(self.stage_row)
        layout.addWidget(self.summary)
        layout.addWidget(self.grammar_note)
        layout.addWidget(self.reference_note)
        layout.addWidget(self.bars, 1)
        layout.addWidget(self.continue_hint)
        continue_row = QHBoxLayout()
        continue_row.addStretch(1)
        continue_row.addWidget(self.continue_button)
        layout.addLayout(continue_row)
        self._update()

    # ---- public API --------------------------------------------------------------------------
    def show_token(self, request_id: int | None, index: int | None) -> None:
        """Pin a token (None, None: follow the latest token as it is generated)."""
        if request_id is None or index is None:
            request_id = index = None
        self._request_id, self._index = request_id, index
        self._update()

    def set_what_if(self, params: SamplingParams | None) -> None:
        """Show the selected token's stages recomputed under `params` (None: as recorded)."""
        self.what_if.params = params
        self._update()

    def show_what_if(
        self,
        request_id: int,
        index: int,
        params: SamplingParams,
        snapshot: TokenSnapshot | None,
        error: str = "",
        notes: tuple[str, ...] = (),
        how: str = WHAT_IF_HOW,
    ) -> None:
        """The shell's answer to `what_if_requested`: the token's snapshot under `params` (and
        how it differs from one real draw, if it does; `how`: on which logits it ran), or why it
        could not be recomputed."""
        if self.what_if.answered((request_id, index, params), snapshot, error, notes, how):
            self._update()

    def set_reference_source(self, source: Callable[[int, int], ReferenceDistribution | None] | None) -> None:
        """Where the full-precision reference of a token comes from (a quality run's results)."""
        self._reference_source = source
        self._update()

    def select_stage(self, name: str | None) -> None:
        """Show the bars after stage `name` (None: the final stage)."""
        self._stage_choice = name
        self._update()

    def choose_candidate(self, row: int | None) -> None:
        """Choose a candidate row of the shown token (None: none) for "continue from here"."""
        shown = self._shown
        if row is not None and shown is not None and 0 <= row < len(self.rows):
            self._chosen_for = (shown.request_id, shown.index)
            self.bars.choose_row(row)
        else:
            self._chosen_for = None
            self.bars.choose_row(None)
        self._sync_continue()

    def chosen_candidate(self) -> tuple[int, int, int] | None:
        """(request id, token index, token id) that "continue from here" would use."""
        row = self.bars.chosen_row
        if self._chosen_for is None or row is None or row >= len(self.rows):
            return None
        return (*self._chosen_for, self.rows[row].token_id)

    def _on_row_clicked(self, row: int) -> None:
        self.choose_candidate(row)

    def _on_row_double_clicked(self, row: int) -> None:
        self.choose_candidate(row)
        self._on_continue_clicked()

    def _on_continue_clicked(self) -> None:
        chosen = self.chosen_candidate()
        if chosen is not None:
            self.continue_requested.emit(*chosen)

    def _sync_continue(self) -> None:
        chosen = self.chosen_candidate()
        row = self.bars.chosen_row
        self.continue_button.setEnabled(chosen is not None)
        if chosen is None or row is None:
            self.continue_button.setText("↳ Continue from here")
            self.continue_hint.setText(CONTINUE_HINT if self._shown is not None else "")
        else:
            text = self.rows[row].text
            self.continue_button.setText(f"↳ Continue with “{text}”")
            self.continue_hint.setText(f"reply #{chosen[0]}, token {chosen[1]}: a new branch from here")

    @property
    def following(self) -> bool:
        return self._request_id is None

    @property
    def rows(self) -> list[BarRow]:
        return self.bars.rows

    def refresh(self, dirty: set[str]) -> None:
        followed = self.following or self._stale
        # A what-if on the followed reply is recomputed once it ends ("requests").
        ended = "requests" in dirty and self.what_if.params is not None and self.following
        if ("tokens" in dirty and followed) or ended:
            self._update()

    # ---- building ----------------------------------------------------------------------------
    def _on_stage_clicked(self, button_id: int) -> None:
        names = [s.name for s in self.stages]
        last = len(names) - 1
        self.select_stage(None if button_id == last else names[button_id])

    def _update(self) -> None:
        token = self.state.token(self._request_id, self._index)
        # A pinned token not yet generated (or dropped) stays stale and is looked up again.
        self._stale = token is None
        self._shown = token
        if self._chosen_for is not None and (
            token is None or (token.request_id, token.index) != self._chosen_for
        ):
            self._chosen_for = None  # another token: its candidates are other rows
            self.bars.choose_row(None)
        self._sync_continue()
        if token is None:
            self._clear(
                "No tokens yet: send a message to see how each token was chosen."
                if self.following
                else "That token is not available."
            )
            return
        if token.snapshot is None:
            self._clear(
                f"Token {token.index} of reply #{token.request_id} has no recorded distribution: "
                "set the snapshot size (top-N candidates) above 0 to record them."
            )
            self._set_header(token, None)
            return
        shown = self._snapshot_for(token)
        if shown is None:
            self._clear(f"what-if failed: {self.what_if_error}")
            return
        stages = shown.stages
        self.stages = stages
        names = tuple(s.name for s in stages)
        index = names.index(self._stage_choice) if self._stage_choice in names else len(stages) - 1
        self.stage_name = names[index]
        self._sync_stage_buttons(stages, index, vocab=stages[0].kept_count)
        self.summary.setText(stage_summary(stages[index], stages[0].kept_count))
        self._show_grammar(shown)
        rows = bar_rows(shown, stages, index)
        self.bars.set_rows(self._with_reference(token, rows), names)
        self._set_header(token, shown)

    def _with_reference(self, token: TokenGenerated, rows: list[BarRow]) -> list[BarRow]:
        """The rows with the reference's probability where a quality run has this token."""
        ref = self._reference_source(token.request_id, token.index) if self._reference_source else None
        self.reference = ref
        if ref is None:
            self.reference_note.hide()
            return rows
        self.reference_note.setText(
            f"<span style='color:{REFERENCE_COLOUR}'>▎</span> {ref.label}, raw: KL {ref.kl:.3g} nats here;"
            f" its top token <b>{_html(visible(ref.top_text))}</b> {percent(ref.top_prob)}"
        )
        self.reference_note.show()
        return [dataclasses.replace(row, reference_prob=ref.probs.get(row.token_id)) for row in rows]

    def _snapshot_for(self, token: TokenGenerated) -> TokenSnapshot | None:
        """The snapshot the bars show: as recorded, or the what-if's once the shell answered
        (None: the what-if failed, `what_if_error` says why)."""
        recorded = token.snapshot
        assert recorded is not None
        self.what_if_error = None
        if self.what_if.params is None:
            self.banner.hide()
            return recorded
        self.banner.show()
        if is_remote_snapshot(recorded):
            self.banner.setText("what-if needs the engine's raw logits: a remote server's tokens have none")
            return recorded
        view = self.state.requests.get(token.request_id)
        shown = self.what_if.view(token, recorded, self.following and view is not None and not view.done)
        self.banner.setText(shown.banner)
        self.what_if_error = shown.error or None
        if shown.ask is not None:
            self.what_if_requested.emit(*shown.ask)
        return shown.snapshot

    def _show_grammar(self, shown: TokenSnapshot) -> None:
        if shown.grammar is None:
            self.grammar_note.hide()
            return
        g = shown.grammar
        stage = next((s for s in shown.stages if s.name == "grammar"), None)
        detail = grammar_detail(g)
        if self.stage_name == "grammar" or stage is None:
            # its counts are the summary line just above: only what else it did
            text = f"grammar: {detail}" if detail else ""
        else:
            head = stage_summary(stage, g.vocab_size)
            text = f"{head} · {detail}" if detail else head
        self.grammar_note.setText(text)
        self.grammar_note.setVisible(bool(text))

    def _clear(self, message: str) -> None:
        self.grammar_note.hide()
        self.stages, self.stage_name = (), None
        self.reference = None
        self.reference_note.hide()
        self.bars.set_message(message)
        self.summary.setText("")
        self.header.setText(f"<span style='color:{theme.MUTED}'>Token probabilities</span>")
        self._sync_stage_buttons((), -1, 0)
        if self.what_if.params is None:
            self.banner.hide()

    def _set_header(self, token: TokenGenerated, shown: TokenSnapshot | None) -> None:
        where = "latest" if self.following else "selected"
        snap = token.snapshot
        text = (
            f"<b>reply #{token.request_id} · token {token.index}</b>"
            f" <span style='color:{theme.MUTED}'>({where})</span>"
            f" drawn <span style='color:{theme.MARK}'><b>{_html(visible(token.text))}</b></span>"
        )
        if snap is not None and is_remote_snapshot(snap):
            text += (
                f" p&nbsp;{percent(snap.drawn_prob)}"
                f" <span style='color:{theme.MUTED}'>(as the server reports it)</span>"
            )
        elif snap is not None and shown is not None:
            stages = shown.stages
            if shown is snap:
                text += (
                    f" p&nbsp;{percent(snap.drawn_prob)} · entropy {snap.entropy:.2f} nats"
                    f" <span style='color:{theme.MUTED}'>(raw {snap.raw_entropy:.2f})</span>"
                )
            else:
                ids = shown.candidate_ids
                drawn = ids.index(snap.drawn_id) if snap.drawn_id in ids else None
                would_be = percent(stages[-1].probs[drawn]) if drawn is not None else "?"
                text += (
                    f" would be p&nbsp;{would_be} · entropy {entropy_text(stages[-1])}"
                    f" <span style='color:{theme.MUTED}'>(raw {snap.raw_entropy:.2f})</span>"
                )
        self.header.setText(text)

    def _sync_stage_buttons(self, stages: tuple[StageSnapshot, ...], checked: int, vocab: int) -> None:
        names = [s.name for s in stages]
        current = [
            self.stage_buttons.button(i).property("stage") for i in range(len(self.stage_buttons.buttons()))
        ]
        if current != names:
            for button in self.stage_buttons.buttons():
                self.stage_buttons.removeButton(button)
                self.stage_bar.removeWidget(button)
                button.deleteLater()
            for i, stage in enumerate(stages):
                button = QToolButton()
                button.setText(stage_label(stage.name))
                button.setCheckable(True)
                button.setProperty("stage", stage.name)
                self.stage_buttons.addButton(button, i)
                self.stage_bar.addWidget(button)
        for i, stage in enumerate(stages):
            button = self.stage_buttons.button(i)
            button.setChecked(i == checked)
            button.setToolTip(stage_summary(stage, vocab))


def _html(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
