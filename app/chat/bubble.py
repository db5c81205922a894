"""One message in the transcript: a header (who, its place at a fork ◀ 2/3 ▶, the reply's
figures, a menu of what can be done with it) over its rendered text (Markdown, or one link per
generated token), and a footer with "Continue" for a reply that was cut off and a mark when the
context limit left it out of the model's prompt. Pure view: the ChatController decides."""

from __future__ import annotations

import time
from collections.abc import Callable

from PySide6.QtCore import Qt, Signal, Slot
from PySide6.QtGui import QAction, QGuiApplication
from PySide6.QtWidgets import (
    QFrame,
    QHBoxLayout,
    QLabel,
    QMenu,
    QPushButton,
    QSizePolicy,
    QToolButton,
    QVBoxLayout,
    QWidget,
)

from app.chat.rich_text import (
    ReplyToken,
    copy_index_from_link,
    plain_html,
    render_markdown,
    token_html,
    token_index_from_link,
)
from app.chat.spec_marks import spec_token_html

# A streaming reply is re-rendered at most once per this many times its last render's cost:
# at most ~1/8 of the GUI thread however long the reply grows (short replies: every frame).
STREAM_RENDER_BUDGET = 8.0
_clock = time.perf_counter  # module-level so tests can drive it


# A token's speculative mark by (request id, token index): "accepted", "resampled", "bonus" or "".
SpecMarkSource = Callable[[int, int], str]

# What a message's menu offers, by role: (action, label, tooltip).
MESSAGE_ACTIONS = {
    "user": (
        ("edit", "Edit and resend…", "Edit this message and send it as a new branch (this one is kept)"),
        ("copy", "Copy text", "Copy the message's text"),
    ),
    "assistant": (
        (
            "regenerate",
            "Regenerate",
            "A new reply here with the current settings (this one is kept as a branch)",
        ),
        (
            "regenerate_same",
            "Regenerate with its settings",
            "A new reply here with the sampling settings this reply was made with",
        ),
        ("continue", "Continue this reply", "Generate on from where this reply ends"),
        ("copy", "Copy text", "Copy the reply's text"),
    ),
}
OUTSIDE_CONTEXT_NOTE = "left out of the model's context (at the limit)"


class MessageBubble(QFrame):
    """One message: a header (who, and facts about the reply) over its rendered text."""

    token_hovered = Signal(object)  # token position, or None when the pointer left the tokens
    token_clicked = Signal(int)
    fork_step = Signal(int)  # -1 / +1: show the previous / next sibling at this fork
    action_requested = Signal(str)  # one of MESSAGE_ACTIONS' names
    code_copied = Signal(int)  # a code block's Copy link put its text on the clipboard

    def __init__(self, role: str, author: str, request_id: int | None = None, parent: QWidget | None = None):
        super().__init__(parent)
        self.role = role
        self.request_id = request_id
        self.message_id: int | None = None  # the stored message it shows (set by the controller)
        self.text = ""
        self.tokens: list[ReplyToken] = []
        self.token_lead = ""  # text before the tokens that has none here (continued after a restart)
        self.code_blocks: list[str] = []
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
        # A reply's figures can be a long line: it wraps in the header's room instead of widening
        # the bubble past the transcript (which would clip the reply's right edge).
        self._meta.setWordWrap(True)
        self._meta.setAlignment(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
        self._meta.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Preferred)
        self._meta.setMinimumWidth(60)
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
        self.fork_prev = QToolButton()
        self.fork_prev.setText("◀")
        self.fork_prev.setToolTip("The previous version of this message (a branch of the conversation)")
        self.fork_prev.clicked.connect(lambda: self.fork_step.emit(-1))
        self.fork_label = QLabel("")
        self.fork_label.setObjectName("bubbleMeta")
        self.fork_next = QToolButton()
        self.fork_next.setText("▶")
        self.fork_next.setToolTip("The next version of this message (a branch of the conversation)")
        self.fork_next.clicked.connect(lambda: self.fork_step.emit(1))
        for button in (self.fork_prev, self.fork_next):
            button.setObjectName("forkButton")
            button.setAutoRaise(True)
        self.set_fork(1, 1)
        self.actions_button = QToolButton()
        self.actions_button.setObjectName("messageActions")
        self.actions_button.setText("⋯")
        self.actions_button.setAutoRaise(True)
        self.actions_button.setToolTip("What to do with this message")
        self.actions_button.setPopupMode(QToolButton.ToolButtonPopupMode.InstantPopup)
        self._menu = QMenu(self)
        self.menu_actions: dict[str, QAction] = {}
        for name, label, tip in MESSAGE_ACTIONS["user" if role == "user" else "assistant"]:
            action = self._menu.addAction(label)
            action.setToolTip(tip)
            action.triggered.connect(lambda _=False, n=name: self.action_requested.emit(n))
            self.menu_actions[name] = action
        self._menu.setToolTipsVisible(True)
        self.actions_button.setMenu(self._menu)
        self.continue_button = QPushButton("Continue")
        self.continue_button.setObjectName("continueButton")
        self.continue_button.setToolTip("Generate on from where this reply stopped")
        self.continue_button.clicked.connect(lambda: self.action_requested.emit("continue"))
        self.continue_button.hide()
        self._context_note = QLabel(f"⤒ {OUTSIDE_CONTEXT_NOTE}")
        self._context_note.setObjectName("contextNote")
        self._context_note.hide()
        self.outside_context = False
        header = QHBoxLayout()
        header.setContentsMargins(0, 0, 0, 0)
        header.setSpacing(4)
        header.addWidget(self._author)
        for widget in (self.fork_prev, self.fork_label, self.fork_next):
            header.addWidget(widget)
        header.addWidget(self._meta, 1)
        header.addWidget(self.actions_button)
        footer = QHBoxLayout()
        footer.setContentsMargins(0, 0, 0, 0)
        footer.addWidget(self._context_note)
        footer.addStretch(1)
        footer.addWidget(self.continue_button)
        # Cards under the text: the reply's tool calls (app.chat.tool_card).
        self.tool_cards: list[QWidget] = []
        self._tool_cards = QVBoxLayout()
        self._tool_cards.setContentsMargins(0, 2, 0, 0)
        self._tool_cards.setSpacing(4)
        layout = self._layout = QVBoxLayout(self)  # kept: subclasses add to it
        layout.setContentsMargins(12, 8, 12, 10)
        layout.setSpacing(4)
        layout.addLayout(header)
        layout.addWidget(self._body)
        layout.addLayout(self._tool_cards)
        layout.addLayout(footer)

    # ---- content ---------------------------------------------------------------------------
    def add_tool_card(self, card: QWidget) -> None:
        self.tool_cards.append(card)
        self._tool_cards.addWidget(card)

    def clear_tool_cards(self) -> None:
        for card in self.tool_cards:
            self._tool_cards.removeWidget(card)
            card.deleteLater()
        self.tool_cards = []

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

    def set_meta_tooltip(self, text: str) -> None:
        self._meta.setToolTip(text)

    def set_fork(self, position: int, count: int) -> None:
        """This message is version `position` of `count` at its fork (the nav hides for 1)."""
        forked = count > 1
        for widget in (self.fork_prev, self.fork_label, self.fork_next):
            widget.setVisible(forked)
        self.fork_label.setText(f"{position}/{count}")
        self.fork_prev.setEnabled(position > 1)
        self.fork_next.setEnabled(position < count)
        self.fork_position = (position, count)

    def set_busy(self, busy: bool) -> None:
        """While a reply streams the conversation's shape cannot change: no forks, no actions."""
        position, count = self.fork_position
        self.fork_prev.setEnabled(not busy and position > 1)
        self.fork_next.setEnabled(not busy and position < count)
        self.actions_button.setEnabled(not busy)
        self.continue_button.setEnabled(not busy)

    def set_action_enabled(self, name: str, enabled: bool, reason: str = "") -> None:
        action = self.menu_actions.get(name)
        if action is not None:
            action.setEnabled(enabled)
            tip = next(t for n, _, t in MESSAGE_ACTIONS[self._role_key()] if n == name)
            action.setToolTip(tip if enabled or not reason else reason)

    def set_continuable(self, offered: bool, label: str = "Continue") -> None:
        """Offer the Continue button (a reply cut off by a crash, a stop or the token limit)."""
        self.continue_button.setText(label)
        self.continue_button.setVisible(offered)

    def set_outside_context(self, outside: bool) -> None:
        """Marked (and dimmed) when the context limit left this message out of the last prompt."""
        if outside != self.outside_context:
            self.outside_context = outside
            self._context_note.setVisible(outside)
            self.setProperty("outsideContext", outside)
            self.style().unpolish(self)
            self.style().polish(self)

    def _role_key(self) -> str:
        return "user" if self.role == "user" else "assistant"

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

    def set_selected_token(self, position: int | None) -> None:
        if position != self._selected:
            self._selected = position
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
            source, tokens, own = self._spec_marks, self.tokens, self.request_id

            def mark(i: int) -> str:
                request_id, index = self.token_key(i)
                return source(own if request_id is None else request_id, index)

            html = spec_token_html(tokens, mark, self._selected, self._colour, self.token_lead)
        elif self.shows_tokens:
            html = token_html(self.tokens, self._selected, self._colour, self.token_lead)
        else:
            html, self.code_blocks = render_markdown(self.text) if self.text else ("", [])
        self._body.setText(html)

    def token_key(self, position: int) -> tuple[int | None, int]:
        """(request id, token index) of the token at `position`: where its events are."""
        tok = self.tokens[position]
        return (tok.request_id if tok.request_id is not None else self.request_id), tok.index

    # ---- token selection -------------------------------------------------------------------
    @Slot(str)
    def _on_link_hovered(self, link: str) -> None:
        self.token_hovered.emit(token_index_from_link(link))

    @Slot(str)
    def _on_link_activated(self, link: str) -> None:
        index = token_index_from_link(link)
        if index is not None:
            self.token_clicked.emit(index)
            return
        block = copy_index_from_link(link)
        if block is not None and 0 <= block < len(self.code_blocks):
            QGuiApplication.clipboard().setText(self.code_blocks[block])
            self.code_copied.emit(block)
