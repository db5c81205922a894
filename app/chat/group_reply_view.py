"""A reply made of several sequences, in the transcript: n samples side by side, or a beam search
as a live tree of its beams and, once done, the beams ranked with their scores.

Each alternative is a card with a "Keep this" button; the kept one is outlined and is the
assistant message the conversation continues from. `GroupReplyCard` is a `MessageBubble`, so the
transcript, regenerate and edit treat it like any reply; its own text (`text`) is the kept one.
"""

from __future__ import annotations

from collections.abc import Iterable

from PySide6.QtCore import Qt, Signal, Slot
from PySide6.QtGui import QResizeEvent
from PySide6.QtWidgets import (
    QFrame,
    QGridLayout,
    QHBoxLayout,
    QLabel,
    QPushButton,
    QScrollArea,
    QVBoxLayout,
    QWidget,
)

from app.chat.bubble import MessageBubble
from app.chat.group_reply import Alternative, GroupReply
from app.chat.rich_text import markdown_html, plain_html
from live.state import LiveState
from widgets import theme
from widgets.beam_tree import BeamTreeView, format_score
from widgets.theme import seq_rgb

# Cards per row: as many as fit at this width (at most 3), so a reply never wraps to a few words
# a line and a narrow chat pane stacks them.
MIN_CARD_PX = 230
MAX_COLUMNS = 3
TREE_MAX_HEIGHT_PX = 300  # beyond this the tree scrolls (8 beams plus finished hypotheses)
KEEP_TIP = "Make this the reply: it is stored and the conversation continues from it"
FINISH_NOTES = {"stop": "ended", "length": "token limit", "cancelled": "stopped", "pruned": "pruned"}


def _swatch_html(rgb: tuple[int, int, int]) -> str:
    return f"<span style='color:#{rgb[0]:02x}{rgb[1]:02x}{rgb[2]:02x}'>■</span>"


class SequenceCard(QFrame):
    """One sample or beam: title, facts, text and the Keep button."""

    keep_clicked = Signal(int)

    def __init__(self, branch: int, title: str, parent: QWidget | None = None):
        super().__init__(parent)
        self.branch = branch
        self.title = title
        self.text = ""
        self.kept = False
        self.setObjectName("sequenceCard")
        self._title = QLabel(title)
        self._title.setTextFormat(Qt.TextFormat.RichText)
        self._facts = QLabel("")
        self._facts.setObjectName("bubbleMeta")
        self._body = QLabel("")
        self._body.setTextFormat(Qt.TextFormat.RichText)
        self._body.setWordWrap(True)
        self._body.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self._body.setAlignment(Qt.AlignmentFlag.AlignTop | Qt.AlignmentFlag.AlignLeft)
        self.keep_button = QPushButton("Keep this")
        self.keep_button.setToolTip(KEEP_TIP)
        self.keep_button.setEnabled(False)
        self.keep_button.clicked.connect(self._on_keep)
        self._facts.setWordWrap(True)
        footer = QHBoxLayout()
        footer.setContentsMargins(0, 0, 0, 0)
        footer.addStretch(1)
        footer.addWidget(self.keep_button)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(8, 6, 8, 6)
        layout.setSpacing(3)
        layout.addWidget(self._title)
        layout.addWidget(self._facts)
        layout.addWidget(self._body, 1)
        layout.addLayout(footer)
        self._restyle()

    def set_swatch(self, rgb: tuple[int, int, int] | None) -> None:
        self._title.setText((_swatch_html(rgb) + "&nbsp;" if rgb else "") + f"<b>{self.title}</b>")

    def set_text(self, text: str, streaming: bool) -> None:
        # Plain text while streaming (cheap to re-render every frame), Markdown once final.
        self.text = text
        self._body.setText(plain_html(text) if streaming else (markdown_html(text) if text else ""))

    def set_facts(self, text: str) -> None:
        self._facts.setText(text)

    def set_kept(self, kept: bool) -> None:
        self.kept = kept
        self.keep_button.setText("✓ Kept" if kept else "Keep this")
        self._restyle()

    def body_text(self) -> str:
        return self._body.text()

    def _restyle(self) -> None:
        border = theme.ACCENT if self.kept else theme.BORDER
        self.setStyleSheet(
            f"#sequenceCard {{ border: {2 if self.kept else 1}px solid {border}; border-radius: 6px;"
            f" background: {theme.SURFACE}; }}"
        )

    @Slot()
    def _on_keep(self) -> None:
        self.keep_clicked.emit(self.branch)


def alternative_facts(alt: Alternative, kind: str) -> str:
    parts = []
    if alt.num_tokens:
        parts.append(f"{alt.num_tokens} tokens")
    if alt.score is not None:
        what = "score" if kind == "beams" else "log p"
        parts.append(f"{what} {format_score(alt.score)}")
    if alt.finish_reason:
        parts.append(FINISH_NOTES.get(alt.finish_reason, alt.finish_reason))
    return " · ".join(parts)


class GroupReplyCard(MessageBubble):
    keep_requested = Signal(int)  # branch of the alternative to keep

    def __init__(
        self,
        author: str,
        request_id: int | None,
        kind: str,
        size: int,
        live: LiveState | None = None,
        parent: QWidget | None = None,
    ):
        super().__init__("assistant", author, request_id, parent)
        self.kind, self.num_sequences, self.live = kind, size, live
        self.reply: GroupReply | None = None
        self.message_id: int | None = None  # the stored message it shows (set by the controller)
        self.cards: dict[int, SequenceCard] = {}
        self._keep_enabled = False
        self._keep_reason = ""
        self._columns = 1
        self._body.hide()  # the kept text is shown in its card
        layout = self._layout
        self.heading = QLabel("")
        self.heading.setObjectName("bubbleMeta")
        self.heading.setWordWrap(True)
        layout.addWidget(self.heading)
        self.tree: BeamTreeView | None = None
        if kind == "beams" and live is not None:
            self.tree = BeamTreeView(live, request_id)
            scroll = QScrollArea()
            scroll.setWidget(self.tree)
            scroll.setWidgetResizable(False)
            scroll.setFrameShape(QFrame.Shape.NoFrame)
            scroll.setVerticalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAsNeeded)
            self.tree_scroll = scroll
            layout.addWidget(scroll)
            self._fit_tree_height()
        self._grid_host = QWidget()
        self._grid = QGridLayout(self._grid_host)
        self._grid.setContentsMargins(0, 0, 0, 0)
        self._grid.setSpacing(6)
        layout.addWidget(self._grid_host)
        if kind == "samples":
            self._make_cards(range(size))
            self.heading.setText(f"{size} samples of one prompt, sharing its KV pages")
        else:
            self.heading.setText(f"beam search, {size} beams: each step keeps the {size} best-scoring")

    def _make_cards(self, branches: Iterable[int]) -> None:
        for card in self.cards.values():
            self._grid.removeWidget(card)
            card.deleteLater()
        self.cards = {}
        for branch in branches:
            title = f"Sample {branch + 1}" if self.kind == "samples" else f"Beam {branch + 1}"
            if self.kind == "beams" and branch == 0:
                title += " (best)"
            card = SequenceCard(branch, title)
            card.keep_clicked.connect(self.keep_requested)
            self.cards[branch] = card
        self._place_cards()
        self._refresh_swatches()

    def _place_cards(self) -> None:
        for card in self.cards.values():
            self._grid.removeWidget(card)
        for i, card in enumerate(self.cards.values()):
            self._grid.addWidget(card, i // self._columns, i % self._columns)
        for column in range(MAX_COLUMNS):  # equal widths for the columns in use
            self._grid.setColumnStretch(column, 1 if column < self._columns else 0)

    def resizeEvent(self, event: QResizeEvent) -> None:  # noqa: N802 - Qt override
        super().resizeEvent(event)
        margins = self._layout.contentsMargins()
        width = event.size().width() - margins.left() - margins.right()
        columns = max(1, min(MAX_COLUMNS, len(self.cards), width // MIN_CARD_PX))
        if columns != self._columns:
            self._columns = columns
            self._place_cards()

    # ---- streaming -------------------------------------------------------------------------
    def set_sample_text(self, branch: int, text: str, num_tokens: int) -> None:
        card = self.cards.get(branch)
        if card is not None:
            card.set_text(text, streaming=True)
            card.set_facts(f"{num_tokens} tokens")

    def refresh(self, dirty: set[str]) -> None:
        """A render frame: the beam tree and the samples' colours follow the store."""
        if "groups" not in dirty:
            return
        if self.tree is not None:
            at_end = self._tree_at_end()
            self.tree.refresh(dirty)
            self._fit_tree_height()
            if at_end:
                bar = self.tree_scroll.horizontalScrollBar()
                bar.setValue(bar.maximum())
        self._refresh_swatches()

    def _fit_tree_height(self) -> None:
        # As tall as the tree (plus its horizontal scroll bar), up to TREE_MAX_HEIGHT_PX.
        assert self.tree is not None, "a beam search's card has its tree"
        bar = self.tree_scroll.horizontalScrollBar().sizeHint().height()
        self.tree_scroll.setFixedHeight(min(TREE_MAX_HEIGHT_PX, self.tree.height() + bar + 2))

    def _tree_at_end(self) -> bool:
        bar = self.tree_scroll.horizontalScrollBar()
        return bar.value() >= bar.maximum() - 4

    def _refresh_swatches(self) -> None:
        # A sample's colour is its sequence's colour in the page map (beams change sequences
        # every step, so their cards have none; the tree's borders carry it).
        group = self.live.groups.get(self.request_id) if self.live and self.request_id is not None else None
        for branch, card in self.cards.items():
            seq_id = group.seq_of_branch(branch) if group is not None and self.kind == "samples" else None
            card.set_swatch(seq_rgb(seq_id) if seq_id is not None else None)

    # ---- results ---------------------------------------------------------------------------
    def show_results(self, reply: GroupReply) -> None:
        """The final (or stored) alternatives, with the kept one marked."""
        self.reply = reply
        self.kind = reply.kind
        if set(self.cards) != {a.branch for a in reply.alternatives}:
            self._make_cards([a.branch for a in reply.alternatives])
        for alt in reply.alternatives:
            card = self.cards[alt.branch]
            card.set_text(alt.text, streaming=False)
            card.set_facts(alternative_facts(alt, reply.kind))
        if reply.kind == "beams":
            self.heading.setText(
                f"beam search, {len(reply.alternatives)} beams ranked by score (sum of log p / length^penalty)"
            )
        else:
            self.heading.setText(
                f"{len(reply.alternatives)} samples; log p = the sum of each one's token log-probs"
            )
        self.set_kept(reply.kept)

    def set_kept(self, branch: int | None) -> None:
        if self.reply is not None:
            self.reply.kept = branch
            self.text = self.reply.kept_text
        for b, card in self.cards.items():
            card.set_kept(b == branch)
        self._sync_keep_buttons()

    def set_keep_enabled(self, enabled: bool, reason: str = "") -> None:
        self._keep_enabled = enabled
        self._keep_reason = reason
        self._sync_keep_buttons()

    def _sync_keep_buttons(self) -> None:
        done = self.reply is not None
        for card in self.cards.values():
            card.keep_button.setEnabled(done and self._keep_enabled and not card.kept)
            card.keep_button.setToolTip(
                self._keep_reason if done and not self._keep_enabled and self._keep_reason else KEEP_TIP
            )
