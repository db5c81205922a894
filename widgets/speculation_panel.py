"""Speculative decoding, as measured: acceptance, accepted length by draft position, target
forwards per token, the selected token's round (q, p and min(1, p/q) of each draft) and the
speedup against the same settings without speculation.

Figures for a finished reply are its engine RequestStats; while a reply streams they are folded
from its SpecRound events so far. The speedup comes only from a measurement the user starts.
A round names its drafts by id; their texts come from the engine's tokenizer through the shell
(`texts_needed`, answered with `add_token_texts`), never decoded here.
"""

from __future__ import annotations

import html
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (
    QHBoxLayout,
    QLabel,
    QPushButton,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from engine.events import SpecRound
from live.state import LiveState
from widgets import theme
from widgets.plot_style import styled_plot

ROUND_COLUMNS = ("draft token", "q (draft)", "p (target)", "min(1, p/q)", "verdict")


@dataclass(frozen=True, slots=True)
class Acceptance:
    """One reply's speculative figures."""

    request_id: int
    rounds: int
    drafted: int
    accepted: int
    generated: int
    target_forwards: int
    accepted_by_position: tuple[int, ...]
    drafted_by_position: tuple[int, ...]
    final: bool  # from RequestStats (True) or folded from the rounds so far
    # The draft length the engine gives the request now (adaptive: 0 when drafts stopped
    # paying; None before any round or change), and the time its rounds saved against plain
    # decoding as the engine measured it (negative: lost).
    draft_length: int | None = None
    saved_s: float = 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        return self.accepted / self.rounds if self.rounds else 0.0

    @property
    def forwards_per_token(self) -> float:
        return self.target_forwards / self.generated if self.generated else 0.0

    @property
    def saved_ms_per_token(self) -> float:
        return 1e3 * self.saved_s / self.generated if self.generated else 0.0

    def rate_by_position(self) -> np.ndarray:
        drafted = np.asarray(self.drafted_by_position, float)
        accepted = np.asarray(self.accepted_by_position, float)
        return np.divide(accepted, drafted, out=np.zeros_like(drafted), where=drafted > 0)


def acceptance_of(state: LiveState, request_id: int) -> Acceptance | None:
    """The request's figures: its RequestStats once finished, else its rounds so far."""
    view = state.requests.get(request_id)
    if view is None:
        return None
    rounds = [r for (rid, _), r in state.spec_rounds.items() if rid == request_id]
    # the latest change the engine announced, else the length the latest round was given
    draft_length = state.draft_lengths.get(request_id)
    if draft_length is None and rounds:
        draft_length = max(rounds, key=lambda r: r.round).draft_length
    if view.finished is not None:
        s = view.finished.stats
        if not s.spec_rounds:
            return None
        return Acceptance(
            request_id,
            s.spec_rounds,
            s.spec_drafted,
            s.spec_accepted,
            s.generated_tokens,
            s.target_forwards,
            s.spec_accepted_by_position,
            s.spec_drafted_by_position,
            True,
            draft_length,
            s.spec_saved_s,
        )
    if not rounds:
        return None
    width = max(len(r.draft_ids) for r in rounds)
    drafted = [sum(1 for r in rounds if len(r.draft_ids) > i) for i in range(width)]
    accepted = [sum(1 for r in rounds if r.accepted > i) for i in range(width)]
    # A round is one target forward; tokens before the first round came from plain steps.
    plain_tokens = sum(1 for t in view.tokens if t.spec_round < 0)
    return Acceptance(
        request_id,
        len(rounds),
        sum(len(r.draft_ids) for r in rounds),
        sum(r.accepted for r in rounds),
        len(view.tokens),
        len(rounds) + plain_tokens,
        tuple(accepted),
        tuple(drafted),
        False,
        draft_length,
        sum(r.saved_s for r in rounds),
    )


def saving_text(a: Acceptance) -> str:
    """The draft length now and what speculation saved or lost per token, as measured."""
    if a.draft_length is None:
        length = ""
    elif a.draft_length == 0:
        length = "draft length now <b>0</b> (drafts stopped paying: plain decoding until they would again) · "
    else:
        length = f"draft length now <b>{a.draft_length}</b> · "
    ms = a.saved_ms_per_token
    verdict = f"saved <b>{ms:.2f} ms</b>" if ms >= 0 else f"lost <b>{-ms:.2f} ms</b>"
    return f"{length}{verdict} per token against plain decoding (measured by the engine)"


def latest_speculative_request(state: LiveState) -> int | None:
    """The newest request that ran speculative rounds."""
    ids = {rid for rid, _ in state.spec_rounds}
    ids |= {rid for rid, v in state.requests.items() if v.finished and v.finished.stats.spec_rounds}
    ids &= set(state.requests)
    return max(ids) if ids else None


def round_rows(spec_round: SpecRound, token_text: Callable[[int], str]) -> list[tuple[str, ...]]:
    """One row per draft token: its text, q, p, min(1, p/q) and whether it was kept."""
    rows = []
    for i, draft_id in enumerate(spec_round.draft_ids):
        examined = i < len(spec_round.p_probs)
        q = spec_round.q_probs[i] if i < len(spec_round.q_probs) else float("nan")
        p = spec_round.p_probs[i] if examined else float("nan")
        a = spec_round.accept_probs[i] if i < len(spec_round.accept_probs) else float("nan")
        if i < spec_round.accepted:
            verdict = "accepted"
        elif i == spec_round.accepted and examined:
            verdict = "rejected"
        else:
            verdict = "not examined"
        rows.append(
            (
                repr(token_text(draft_id)),
                f"{q:.3f}",
                f"{p:.3f}" if examined else "—",
                f"{a:.3f}" if examined else "—",
                verdict,
            )
        )
    return rows


class SpeculationPanel(QWidget):
    measure_requested = Signal()
    texts_needed = Signal(object)  # tuple of token ids whose text the round table lacks

    def __init__(self, state: LiveState, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.state = state
        self.token_texts: dict[int, str] = {}  # token id -> its text, from the engine's tokenizer
        self._asked: set[int] = set()
        self.acceptance: Acceptance | None = None
        self._selected: tuple[int, int] | None = None
        self.setObjectName("speculationPanel")
        self.setStyleSheet(
            f"#speculationPanel, #speculationPanel QLabel {{ background: {theme.BACKGROUND};"
            f" color: {theme.TEXT}; }}"
        )
        self.summary = QLabel("No speculative reply yet: turn speculation on in Controls and send a message.")
        self.summary.setTextFormat(Qt.TextFormat.RichText)
        self.summary.setWordWrap(True)
        self.plot = styled_plot()
        item = self.plot.getPlotItem()
        item.setLabel("bottom", "draft position")
        item.setLabel("left", "kept")
        self.plot.setToolTip(
            "Bar i: the share of rounds with an i-th draft token in which the target kept it"
        )
        item.setYRange(0, 1, padding=0.02)
        self.bars = pg.BarGraphItem(x=[], height=[], width=0.7, brush=theme.SERIES["kv_used"])
        item.addItem(self.bars)
        self.plot.setMinimumHeight(120)
        self.round_label = QLabel("Select a token in the chat (Tokens view) to see its round.")
        self.round_label.setWordWrap(True)
        self.round_table = QTableWidget(0, len(ROUND_COLUMNS))
        self.round_table.setHorizontalHeaderLabels(ROUND_COLUMNS)
        self.round_table.verticalHeader().setVisible(False)
        self.round_table.verticalHeader().setDefaultSectionSize(self.fontMetrics().height() + 6)
        self.round_table.setEditTriggers(QTableWidget.EditTrigger.NoEditTriggers)
        self.measure_button = QPushButton("Measure speedup")
        self.measure_button.setToolTip(
            "Replay the conversation's last prompt through the engine with and without speculation "
            "(same settings, same number of tokens) and compare tokens/s"
        )
        self.measure_button.clicked.connect(self.measure_requested)
        self.speedup_label = QLabel("Speedup not measured yet.")
        self.speedup_label.setTextFormat(Qt.TextFormat.RichText)
        self.speedup_label.setWordWrap(True)
        measure_row = QHBoxLayout()
        measure_row.addWidget(self.measure_button)
        measure_row.addWidget(self.speedup_label, 1)
        # Bars beside the round: a bottom dock is wide and short.
        round_column = QVBoxLayout()
        round_column.addWidget(self.round_label)
        round_column.addWidget(self.round_table, 1)
        body = QHBoxLayout()
        body.addWidget(self.plot, 2)
        body.addLayout(round_column, 3)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(6, 6, 6, 6)
        layout.addWidget(self.summary)
        layout.addLayout(measure_row)
        layout.addLayout(body, 1)

    # ---- inputs ----------------------------------------------------------------------------
    def add_token_texts(self, texts: dict[int, str]) -> None:
        """Texts of token ids asked for by `texts_needed`."""
        self.token_texts.update(texts)
        self._update_round()

    def clear_token_texts(self) -> None:
        """Another model (another tokenizer): ids may name other texts now."""
        self.token_texts.clear()
        self._asked.clear()

    def token_text(self, token_id: int) -> str:
        return self.token_texts.get(token_id, f"#{token_id}")

    def show_token(self, request_id: int | None, index: int | None) -> None:
        """The chat's selected token (None, None: none selected)."""
        self._selected = None if request_id is None or index is None else (request_id, index)
        self._update_round()

    def refresh(self, dirty: set[str]) -> None:
        if dirty & {"speculation", "requests"}:
            self._update_summary()
            if self._selected is not None:
                self._update_round()

    # ---- measurement -----------------------------------------------------------------------
    def set_measuring(self, message: str | None) -> None:
        """A measurement in progress (its step in words), or None when it has ended."""
        self.measure_button.setEnabled(message is None)
        if message is not None:
            self.speedup_label.setText(f"Measuring… {html.escape(message)}")

    def show_speedup(self, result) -> None:
        spec, plain = result.speculative, result.plain
        verdict = (
            f"<b>{result.speedup:.2f}× faster</b> with {result.proposer}"
            if result.speedup >= 1
            else f"<b style='color: {theme.WHAT_IF}'>"
            f"Speculation slows this down: {result.speedup:.2f}× the speed without it</b> "
            f"({result.proposer}: drafting and the wider verify forward cost more than the kept drafts save)"
        )
        self.speedup_label.setText(
            f"{verdict}<br>with: {spec.tokens_per_s:.1f} tokens/s ({spec.tokens} tokens, "
            f"acceptance {spec.stats.acceptance_rate:.0%}) · without: {plain.tokens_per_s:.1f} tokens/s "
            f"({plain.tokens} tokens)"
        )

    def show_measure_error(self, message: str) -> None:
        self.speedup_label.setText(f"Could not measure: {html.escape(message)}")

    # ---- drawing ---------------------------------------------------------------------------
    def _update_summary(self) -> None:
        request_id = latest_speculative_request(self.state)
        a = acceptance_of(self.state, request_id) if request_id is not None else None
        self.acceptance = a
        if a is None:
            self.bars.setOpts(x=[], height=[])
            return
        where = "reply" if a.final else "reply so far"
        self.summary.setText(
            f"Request {a.request_id} ({where}): acceptance <b>{a.acceptance_rate:.0%}</b> "
            f"({a.accepted} of {a.drafted} drafts) · mean accepted length <b>{a.mean_accepted_length:.2f}</b> "
            f"per round ({a.rounds} rounds) · target forwards per token <b>{a.forwards_per_token:.2f}</b>"
            f"<br>{saving_text(a)}"
        )
        rates = a.rate_by_position()
        positions = np.arange(1, len(rates) + 1)
        self.bars.setOpts(x=positions, height=rates)
        self.plot.getPlotItem().getAxis("bottom").setTicks([[(int(x), str(int(x))) for x in positions]])

    def _update_round(self) -> None:
        spec_round = self.state.spec_round(*self._selected) if self._selected else None
        if spec_round is None:
            self.round_table.setRowCount(0)
            self.round_label.setText(
                "The selected token came from a plain step (no draft round)."
                if self._selected
                else "Select a token in the chat (Tokens view) to see its round."
            )
            return
        ending = "a bonus token" if spec_round.bonus else "a token resampled from the residual"
        self.round_label.setText(
            f"Round {spec_round.round} ({spec_round.proposer}): {spec_round.accepted} of "
            f"{len(spec_round.draft_ids)} drafts accepted, then {ending}."
        )
        unknown = tuple(i for i in dict.fromkeys(spec_round.draft_ids) if i not in self.token_texts)
        if unknown and not self._asked.issuperset(unknown):
            self._asked.update(unknown)
            self.texts_needed.emit(unknown)
        rows = round_rows(spec_round, self.token_text)
        self.round_table.setRowCount(len(rows))
        for r, row in enumerate(rows):
            for c, value in enumerate(row):
                self.round_table.setItem(r, c, QTableWidgetItem(value))
        self.round_table.resizeColumnsToContents()
