"""The chat pane's widgets: message bubbles in a scrolling transcript, the input box, the system
prompt and the action buttons. Pure view: the ChatController decides what they show."""

from __future__ import annotations

import time
from collections.abc import Callable

from PySide6.QtCore import Qt, Signal, Slot
from PySide6.QtGui import QKeyEvent
from PySide6.QtWidgets import (
    QCheckBox,
    QFrame,
    QHBoxLayout,
    QLabel,
    QPlainTextEdit,
    QPushButton,
    QScrollArea,
    QSizePolicy,
    QVBoxLayout,
    QWidget,
)

from app.chat.rich_text import (
    ReplyToken,
    markdown_html,
    plain_html,
    probability_legend_html,
    token_html,
    token_index_from_link,
)
from app.chat.spec_marks import spec_legend_html, spec_token_html

# Within this many pixels of the bottom, the transcript counts as "following" the stream and
# keeps scrolling with it; further up, the reader is looking back and is left alone.
FOLLOW_SLACK_PX = 48
# Replies get the width; the user's own messages are indented from the left.
USER_INDENT_PX = 72
REPLY_INDENT_PX = 24
# A streaming reply is re-rendered at most once per this many times its last render's cost:
# at most ~1/8 of the GUI thread however long the reply grows (short replies: every frame).
STREAM_RENDER_BUDGET = 8.0
_clock = time.perf_counter  # module-level so tests can drive it


# A token's speculative mark by (request id, token index): "accepted", "resampled", "bonus" or "".
SpecMarkSource = Callable[[int, int], str]


class MessageBubble(QFrame):
    """One message: a header (who, and facts about the reply) over its rendered text."""

    token_hovered = Signal(object)  # token index, or None when the pointer left the tokens
    token_clicked = Signal(int)

    def __init__(self, role: str, author: str, request_id: int | None = None, parent: QWidget | None = None):
        super().__init__(parent)
        self.role = role
        self.request_id = request_id
        self.text = ""
        self.tokens: list[ReplyToken] = []
        self._token_view = False
        self._colour = False
        self._selected: int | None = None
        self._rendered_at = 0.0  # perf_counter() after the last render
        self._render_cost = 0.0  # seconds the last render took
        self._spec_marks: SpecMarkSource | None = None
        self.setObjectName("userBubble" if role == "user" else "assistantBubble")
        self._author = QLabel(author)
        self._author.setObjectName("bubbleAuthor")
        self._meta = QLabel("")
        self._meta.setObjectName("bubbleMeta")
        self._body = QLabel()
        self._body.setObjectName("bubbleBody")
        self._body.setTextFormat(Qt.TextFormat.RichText)
        self._body.setWordWrap(True)
        self._body.setOpenExternalLinks(False)
        self._body.setTextInteractionFlags(
            Qt.TextInteractionFlag.TextSelectableByMouse | Qt.TextInteractionFlag.LinksAccessibleByMouse
        )
        self._body.setSizePolicy(QSizePolicy.Policy.Preferred, QSizePolicy.Policy.Minimum)
        self._body.linkHovered.connect(self._on_link_hovered)
        self._body.linkActivated.connect(self._on_link_activated)
        header = QHBoxLayout()
        header.setContentsMargins(0, 0, 0, 0)
        header.addWidget(self._author)
        header.addStretch(1)
        header.addWidget(self._meta)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(12, 8, 12, 10)
        layout.setSpacing(4)
        layout.addLayout(header)
        layout.addWidget(self._body)

    # ---- content ---------------------------------------------------------------------------
    def set_text(self, text: str) -> None:
        self.text = text
        self._render()

    def add_tokens(self, tokens: list[ReplyToken], text: str) -> None:
        """Streaming: the reply grew. Re-rendered now, or on a later frame when the last render
        was costly (a long reply re-lays out all its text each time, so a render every frame
        would grow to dominate the GUI thread and, through the GIL, slow the engine)."""
        self.tokens.extend(tokens)
        self.text = text
        if _clock() - self._rendered_at >= self._render_cost * STREAM_RENDER_BUDGET:
            self._render()

    def set_meta(self, text: str, kind: str = "") -> None:
        self._meta.setText(text)
        if self._meta.property("kind") != kind:  # re-polishing restyles: only when it changes
            self._meta.setProperty("kind", kind)
            self._meta.style().unpolish(self._meta)
            self._meta.style().polish(self._meta)

    def set_view(self, token_view: bool, colour_by_probability: bool) -> None:
        if (token_view, colour_by_probability) != (self._token_view, self._colour):
            self._token_view, self._colour = token_view, colour_by_probability
            self._render()

    def set_spec_marks(self, source: SpecMarkSource | None) -> None:
        """Colour tokens by their speculative mark (None: no marks)."""
        if source is not self._spec_marks:
            self._spec_marks = source
            if self.shows_tokens:
                self._render()

    def set_selected_token(self, index: int | None) -> None:
        if index != self._selected:
            self._selected = index
            if self.shows_tokens:
                self._render()

    @property
    def shows_tokens(self) -> bool:
        return self._token_view and bool(self.tokens)

    def body_html(self) -> str:
        return self._body.text()

    def _render(self) -> None:
        start = _clock()
        self._draw()
        self._rendered_at = _clock()
        self._render_cost = self._rendered_at - start

    def _draw(self) -> None:
        if self.role == "user":
            html = plain_html(self.text)
        elif self.shows_tokens and self._spec_marks is not None and self.request_id is not None:
            source, request_id = self._spec_marks, self.request_id
            html = spec_token_html(self.tokens, lambda i: source(request_id, i), self._selected, self._colour)
        elif self.shows_tokens:
            html = token_html(self.tokens, self._selected, self._colour)
        else:
            html = markdown_html(self.text) if self.text else ""
        self._body.setText(html)

    # ---- token selection -------------------------------------------------------------------
    @Slot(str)
    def _on_link_hovered(self, link: str) -> None:
        self.token_hovered.emit(token_index_from_link(link))

    @Slot(str)
    def _on_link_activated(self, link: str) -> None:
        index = token_index_from_link(link)
        if index is not None:
            self.token_clicked.emit(index)


class ChatTranscript(QScrollArea):
    """The conversation so far; follows a streaming reply while the reader is at the bottom."""

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("transcript")
        self.setWidgetResizable(True)
        self.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self._inner = QWidget()
        self._inner.setObjectName("transcriptInner")
        self._layout = QVBoxLayout(self._inner)
        self._layout.setContentsMargins(16, 12, 16, 12)
        self._layout.setSpacing(10)
        self._layout.addStretch(1)
        self.setWidget(self._inner)
        self._follow = True
        self.verticalScrollBar().rangeChanged.connect(self._on_range_changed)
        self.verticalScrollBar().valueChanged.connect(self._on_scrolled)
        self.bubbles: list[MessageBubble] = []
        self.spec_marks: SpecMarkSource | None = None  # set while the speculative marks are shown
        self._rows: list[QWidget] = []
        self._placeholder = QLabel()
        self._placeholder.setObjectName("transcriptPlaceholder")
        self._placeholder.setAlignment(Qt.AlignmentFlag.AlignCenter)
        self._placeholder.setWordWrap(True)
        self._layout.insertWidget(0, self._placeholder)

    def set_placeholder(self, text: str) -> None:
        self._placeholder.setText(text)
        self._placeholder.setVisible(not self.bubbles and bool(text))

    def clear(self) -> None:
        self.remove_from(0)
        self._follow = True
        self._placeholder.setVisible(bool(self._placeholder.text()))

    def add(self, bubble: MessageBubble) -> MessageBubble:
        self._placeholder.setVisible(False)
        # User messages sit to the right, replies to the left: who said what at a glance.
        row = QWidget()
        row_layout = QHBoxLayout(row)
        row_layout.setContentsMargins(0, 0, 0, 0)
        if bubble.role == "user":
            row_layout.addSpacing(USER_INDENT_PX)
        row_layout.addWidget(bubble)
        if bubble.role != "user":
            row_layout.addSpacing(REPLY_INDENT_PX)
        self._layout.insertWidget(self._layout.count() - 1, row)
        self._rows.append(row)
        self.bubbles.append(bubble)
        bubble.set_spec_marks(self.spec_marks)
        self._follow = True
        return bubble

    def remove_from(self, position: int) -> None:
        """Drop bubbles[position:] (edit-and-resend, regenerate)."""
        for row in self._rows[position:]:
            self._layout.removeWidget(row)
            row.deleteLater()
        del self._rows[position:]
        del self.bubbles[position:]

    @Slot(int, int)
    def _on_range_changed(self, _minimum: int, maximum: int) -> None:
        if self._follow:
            self.verticalScrollBar().setValue(maximum)

    @Slot(int)
    def _on_scrolled(self, value: int) -> None:
        self._follow = value >= self.verticalScrollBar().maximum() - FOLLOW_SLACK_PX


class ChatInput(QPlainTextEdit):
    """Enter sends; Shift+Enter starts a new line; Escape cancels an edit."""

    submitted = Signal()
    escaped = Signal()

    def keyPressEvent(self, event: QKeyEvent) -> None:  # noqa: N802 - Qt override
        enter = event.key() in (Qt.Key.Key_Return, Qt.Key.Key_Enter)
        if enter and not event.modifiers() & Qt.KeyboardModifier.ShiftModifier:
            self.submitted.emit()
            return
        if event.key() == Qt.Key.Key_Escape:
            self.escaped.emit()
            return
        super().keyPressEvent(event)


class ChatPane(QWidget):
    """System prompt, transcript, input and the actions on the conversation."""

    send_requested = Signal(str)
    stop_requested = Signal()
    regenerate_requested = Signal()
    edit_requested = Signal()
    edit_cancelled = Signal()
    system_prompt_edited = Signal(str)
    view_changed = Signal(bool, bool)  # token view, colour by probability

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("chatPane")
        self.system_prompt = QPlainTextEdit()
        self.system_prompt.setObjectName("systemPrompt")
        self.system_prompt.setPlaceholderText("System prompt (optional): how the assistant should behave")
        self.system_prompt.setFixedHeight(46)
        self.system_prompt.textChanged.connect(self._on_system_prompt_changed)
        self.transcript = ChatTranscript()
        self.input = ChatInput()
        self.input.setObjectName("chatInput")
        self.input.setPlaceholderText("Message the model…  (Enter sends, Shift+Enter for a new line)")
        self.input.setFixedHeight(72)
        self.input.submitted.connect(self._on_submit)
        self.input.escaped.connect(self.edit_cancelled)

        self.send_button = QPushButton("Send")
        self.send_button.setObjectName("sendButton")
        self.send_button.clicked.connect(self._on_submit)
        self.stop_button = QPushButton("Stop")
        self.stop_button.setToolTip("Stop the reply here; what was generated so far is kept")
        self.stop_button.clicked.connect(self.stop_requested)
        self.regenerate_button = QPushButton("Regenerate")
        self.regenerate_button.setToolTip("Replace the last reply with a new one (current sampling settings)")
        self.regenerate_button.clicked.connect(self.regenerate_requested)
        self.edit_button = QPushButton("Edit last")
        self.edit_button.setToolTip("Edit your last message and send it again (its reply is replaced)")
        self.edit_button.clicked.connect(self.edit_requested)

        self.token_view = QCheckBox("Tokens")
        self.token_view.setToolTip(
            "Show replies as their generated tokens: hover a token to see its distribution in the "
            "Probabilities panel, click to keep it selected"
        )
        self.colour_tokens = QCheckBox("Colour by p")
        self.colour_tokens.setToolTip("Tint each token by the probability it was drawn with")
        self.spec_marks = QCheckBox("Draft marks")
        self.spec_marks.setToolTip(
            "Colour tokens by how speculative decoding produced them: accepted drafts, tokens "
            "resampled after a rejection, bonus tokens; select one to see its round in Speculation"
        )
        self.spec_legend = QLabel(spec_legend_html())
        self.spec_legend.setObjectName("legend")
        self._spec_source: SpecMarkSource | None = None
        self.legend = QLabel(probability_legend_html())
        self.legend.setObjectName("legend")
        self.token_view.toggled.connect(self._on_view_toggled)
        self.colour_tokens.toggled.connect(self._on_view_toggled)
        self.spec_marks.toggled.connect(self._on_view_toggled)

        view_row = QHBoxLayout()
        view_row.addWidget(self.token_view)
        view_row.addWidget(self.colour_tokens)
        view_row.addWidget(self.legend)
        view_row.addWidget(self.spec_marks)
        view_row.addWidget(self.spec_legend)
        view_row.addStretch(1)
        actions = QHBoxLayout()
        for button in (self.edit_button, self.regenerate_button, self.stop_button):
            actions.addWidget(button)
        actions.addStretch(1)
        actions.addWidget(self.send_button)

        layout = QVBoxLayout(self)
        layout.setContentsMargins(8, 8, 8, 8)
        layout.setSpacing(6)
        layout.addWidget(self.system_prompt)
        layout.addWidget(self.transcript, 1)
        layout.addLayout(view_row)
        layout.addWidget(self.input)
        layout.addLayout(actions)
        self._editing = False
        self._on_view_toggled()

    # ---- state the controller sets ----------------------------------------------------------
    def set_state(
        self, *, model_ready: bool, loading: bool, generating: bool, can_regenerate: bool, can_edit: bool
    ):
        if generating:
            label = "Generating…"
        elif loading:
            label = "Loading model…"
        elif not model_ready:
            label = "No model loaded"
        else:
            label = "Resend" if self._editing else "Send"
        self.send_button.setText(label)
        self.send_button.setEnabled(model_ready and not generating)
        self.stop_button.setEnabled(generating)
        self.regenerate_button.setEnabled(model_ready and not generating and can_regenerate)
        self.edit_button.setEnabled(not generating and can_edit)

    def set_editing(self, text: str | None) -> None:
        """Put `text` in the input for editing (None ends edit mode)."""
        self._editing = text is not None
        self.input.setProperty("editing", self._editing)
        self.input.style().unpolish(self.input)
        self.input.style().polish(self.input)
        if text is not None:
            self.input.setPlainText(text)
            self.input.setFocus()

    @property
    def editing(self) -> bool:
        return self._editing

    def set_system_prompt(self, text: str) -> None:
        self.system_prompt.blockSignals(True)
        self.system_prompt.setPlainText(text)
        self.system_prompt.blockSignals(False)

    def set_spec_mark_source(self, source: SpecMarkSource | None) -> None:
        """Where token marks come from (the live state's tokens); shown while the toggle is on."""
        self._spec_source = source
        self._on_view_toggled()

    def view_flags(self) -> tuple[bool, bool]:
        return self.token_view.isChecked(), self.colour_tokens.isChecked()

    # ---- slots -----------------------------------------------------------------------------
    @Slot()
    def _on_submit(self) -> None:
        text = self.input.toPlainText().strip()
        if text and self.send_button.isEnabled():
            self.send_requested.emit(text)

    @Slot()
    def _on_system_prompt_changed(self) -> None:
        self.system_prompt_edited.emit(self.system_prompt.toPlainText())

    @Slot()
    def _on_view_toggled(self) -> None:
        tokens, colour = self.view_flags()
        self.colour_tokens.setEnabled(tokens)
        self.legend.setVisible(tokens and colour)
        self.spec_marks.setEnabled(tokens and self._spec_source is not None)
        marks = self.spec_marks.isChecked() and self.spec_marks.isEnabled()
        self.spec_legend.setVisible(marks)
        self.transcript.spec_marks = self._spec_source if marks else None
        for bubble in self.transcript.bubbles:
            bubble.set_view(tokens, colour)
            bubble.set_spec_marks(self.transcript.spec_marks)
        self.view_changed.emit(tokens, colour)
