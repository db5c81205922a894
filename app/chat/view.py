"""The chat pane's widgets: message bubbles (app.chat.bubble) in a scrolling transcript, the
input box, the system prompt, the context meter and the action buttons. Pure view: the
ChatController decides what they show."""

from __future__ import annotations

from PySide6.QtCore import Qt, Signal, Slot
from PySide6.QtGui import QKeyEvent
from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
    QHBoxLayout,
    QLabel,
    QPlainTextEdit,
    QPushButton,
    QScrollArea,
    QSizePolicy,
    QVBoxLayout,
    QWidget,
)

from app.chat.bubble import MessageBubble, SpecMarkSource
from app.chat.chat_settings import ChatSettings
from app.chat.context_meter import ContextMeter
from app.chat.rich_text import probability_legend_html
from app.chat.spec_marks import spec_legend_html

# Within this many pixels of the bottom, the transcript counts as "following" the stream and
# keeps scrolling with it; further up, the reader is looking back and is left alone.
FOLLOW_SLACK_PX = 48
# Replies get the width; the user's own messages are indented from the left.
USER_INDENT_PX = 72
REPLY_INDENT_PX = 24


class ChatTranscript(QScrollArea):
    """The conversation so far; follows a streaming reply while the reader is at the bottom."""

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("transcript")
        self.setWidgetResizable(True)
        self.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self._inner = QWidget()
        self._inner.setObjectName("transcriptInner")
        # The scroll area sizes its widget to at least its minimum size hint, which word-wrapped
        # bubbles compute at their narrowest (far taller than at the real width): a blank gap
        # below the last message. Ignored vertically, the height comes from heightForWidth.
        self._inner.setSizePolicy(QSizePolicy.Policy.Preferred, QSizePolicy.Policy.Ignored)
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
    # The chat's structured output and tools (app.chat.chat_settings): the controller decides.
    structured_requested = Signal()
    tools_toggled = Signal(bool)
    tool_choice_chosen = Signal(str)
    servers_requested = Signal()

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("chatPane")
        self.system_prompt = QPlainTextEdit()
        self.system_prompt.setObjectName("systemPrompt")
        self.system_prompt.setPlaceholderText("System prompt (optional): how the assistant should behave")
        self.system_prompt.setFixedHeight(46)
        self.system_prompt.textChanged.connect(self._on_system_prompt_changed)
        self.transcript = ChatTranscript()
        self.structured_label = QLabel()
        self.structured_label.setObjectName("hint")
        self.structured_button = QPushButton("Structured output…")
        self.structured_button.setToolTip(
            "Hold this chat's replies to a JSON Schema, any JSON object, a regex, a Lark or GBNF grammar, "
            "or a list of choices (the grammar's mask is the sampler's first stage)"
        )
        self.structured_button.clicked.connect(self.structured_requested)
        self.tools_check = QCheckBox("Tools")
        self.tools_check.setToolTip("Offer the MCP servers' tools to the model in this chat")
        self.tools_check.toggled.connect(self.tools_toggled)
        self.tool_choice = QComboBox()
        self.tool_choice.setToolTip(
            "For the reply to each message: the model decides (auto), must call a tool (required), "
            "or must call the named one; the replies that read results always decide"
        )
        self.tool_choice.activated.connect(
            lambda _i: self.tool_choice_chosen.emit(self.tool_choice.currentData())
        )
        self.tools_label = QLabel()
        self.tools_label.setObjectName("hint")
        self.servers_button = QPushButton("MCP servers…")
        self.servers_button.setToolTip("Add or remove MCP servers (stdio or HTTP) and see their tools")
        self.servers_button.clicked.connect(self.servers_requested)
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
        self.regenerate_button.setToolTip(
            "A new version of the last reply with the current sampling settings; the old one stays as a branch (◀ ▶)"
        )
        self.regenerate_button.clicked.connect(self.regenerate_requested)
        self.edit_button = QPushButton("Edit last")
        self.edit_button.setToolTip(
            "Edit your last message and send it again as a new branch; the old one and its reply stay (◀ ▶)"
        )
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
        from app.banner import Banner

        self.banner = Banner()  # a read-only database, a remote engine gone mid-reply
        layout.addWidget(self.banner)
        layout.addWidget(self.system_prompt)
        settings_row = QHBoxLayout()
        settings_row.addWidget(self.structured_button)
        settings_row.addWidget(self.structured_label)
        settings_row.addStretch(1)
        settings_row.addWidget(self.tools_check)
        settings_row.addWidget(self.tool_choice)
        settings_row.addWidget(self.tools_label)
        settings_row.addWidget(self.servers_button)
        layout.addLayout(settings_row)
        layout.addWidget(self.transcript, 1)
        layout.addLayout(view_row)
        layout.addWidget(self.input)
        self.meter = ContextMeter()
        layout.addWidget(self.meter)
        layout.addLayout(actions)
        self._editing = False
        self._on_view_toggled()

    # ---- state the controller sets ----------------------------------------------------------
    def set_state(
        self, *, model_ready: bool, loading: bool, generating: bool, can_regenerate: bool, can_edit: bool
    ) -> None:
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

    def show_chat_settings(
        self, settings: ChatSettings, tools_summary: str, tool_names: tuple[str, ...] = ()
    ) -> None:
        """The chat's structured output and tools as the controller keeps them."""
        grammar = settings.grammar
        self.structured_label.setText("free text" if grammar is None else f"replies follow a {grammar.label}")
        self.tools_check.blockSignals(True)
        self.tools_check.setChecked(settings.tools)
        self.tools_check.blockSignals(False)
        self.tool_choice.blockSignals(True)
        self.tool_choice.clear()
        for label, value in (
            ("auto", "auto"),
            ("required", "required"),
            *((f"call {n}", n) for n in tool_names),
        ):
            self.tool_choice.addItem(label, value)
        if settings.tool_choice not in ("auto", "required") and settings.tool_choice not in tool_names:
            self.tool_choice.addItem(f"call {settings.tool_choice} (not connected)", settings.tool_choice)
        self.tool_choice.setCurrentIndex(max(0, self.tool_choice.findData(settings.tool_choice)))
        self.tool_choice.blockSignals(False)
        self.tool_choice.setEnabled(settings.tools)
        allowed = (
            f"; runs {', '.join(settings.allowed_tools)} without asking" if settings.allowed_tools else ""
        )
        self.tools_label.setText(tools_summary + allowed)

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
