"""A tool call as the chat shows it, under the reply that made it: the raw tokens the model wrote,
the call read out of them (the tool's name, its arguments), and what came of it: waiting for the
user's approval (Run, Always allow in this chat, Deny), running, the result (or the error, or
the timeout), and the KV blocks the result took once the next reply read it. A call that did
not parse shows what the model wrote and why it is no call. Pure view: app.chat.tool_rounds
decides."""

from __future__ import annotations

import json
from typing import Any

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import QFrame, QHBoxLayout, QLabel, QPushButton, QVBoxLayout, QWidget

from widgets import theme

# Shown of a result in the card before "Show all".
RESULT_PREVIEW_CHARS = 600
STATUS_WORDS = {
    "pending": "waiting for your approval",
    "running": "running…",
    "done": "done",
    "error": "error",
    "timeout": "timed out",
    "denied": "not run: you denied it",
    "skipped": "not run: the conversation moved on",
}
STATUS_COLOURS = {"done": "#50fa7b", "error": "#ff6b6b", "timeout": "#ffb86c", "denied": theme.MUTED}


def _html(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def pretty_arguments(arguments: str) -> str:
    try:
        return json.dumps(json.loads(arguments or "{}"), indent=2, ensure_ascii=False)
    except ValueError:
        return arguments


class ToolCallCard(QFrame):
    run_requested = Signal(str)  # call id
    allow_requested = Signal(str)  # call id: run it, and every call of that tool in this chat
    deny_requested = Signal(str)

    def __init__(
        self, call: dict[str, Any] | None, raw_html: str, parent: QWidget | None = None, error: str = ""
    ):
        super().__init__(parent)
        self.setObjectName("toolCallCard")
        self.setStyleSheet(
            "#toolCallCard { border: 1px solid #3b4252; border-radius: 6px; background: #1f232b; }"
            " #toolCallCard QLabel { background: transparent; }"
        )
        self.call_id = call.get("id", "") if call else ""
        self.title = QLabel()
        self.title.setTextFormat(Qt.TextFormat.RichText)
        self.raw = QLabel(raw_html)
        self.raw.setTextFormat(Qt.TextFormat.RichText)
        self.raw.setWordWrap(True)
        self.raw.setToolTip("The tokens the model wrote for this call, separated by ·")
        self.raw.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.arguments = QLabel()
        self.arguments.setTextFormat(Qt.TextFormat.RichText)
        self.arguments.setWordWrap(True)
        self.arguments.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.status = QLabel()
        self.status.setTextFormat(Qt.TextFormat.RichText)
        self.status.setWordWrap(True)
        self.result = QLabel()
        self.result.setTextFormat(Qt.TextFormat.RichText)
        self.result.setWordWrap(True)
        self.result.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.blocks = QLabel()
        self.blocks.setWordWrap(True)
        self.blocks.setStyleSheet(f"color: {theme.MUTED};")
        self.more = QPushButton("Show all")
        self.more.setCheckable(True)
        self.more.toggled.connect(lambda _on: self._show_result())
        self.run_button = QPushButton("Run")
        self.run_button.setToolTip("Run this call once")
        self.allow_button = QPushButton("Always allow")
        self.deny_button = QPushButton("Deny")
        self.deny_button.setToolTip("Do not run it; the model is told you did not allow it")
        self.run_button.clicked.connect(lambda: self.run_requested.emit(self.call_id))
        self.allow_button.clicked.connect(lambda: self.allow_requested.emit(self.call_id))
        self.deny_button.clicked.connect(lambda: self.deny_requested.emit(self.call_id))
        buttons = QHBoxLayout()
        buttons.setContentsMargins(0, 0, 0, 0)
        for button in (self.run_button, self.allow_button, self.deny_button):
            buttons.addWidget(button)
        buttons.addStretch(1)
        buttons.addWidget(self.more)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(10, 6, 10, 6)
        layout.setSpacing(3)
        for widget in (self.title, self.raw, self.arguments, self.status, self.result, self.blocks):
            layout.addWidget(widget)
        layout.addLayout(buttons)
        self._shown: dict[str, Any] = {}
        if call is None:
            self._show_parse_error(error)
        else:
            self.show_call(call)

    def _show_parse_error(self, error: str) -> None:
        self.title.setText("<b>🔧 a tool call that does not parse</b>")
        self.arguments.hide()
        self.status.setText(
            f"<span style='color:#ff6b6b'>{_html(error)}</span>: nothing was run; what the model wrote is kept above"
        )
        for widget in (
            self.result,
            self.blocks,
            self.more,
            self.run_button,
            self.allow_button,
            self.deny_button,
        ):
            widget.hide()

    def show_call(self, call: dict[str, Any]) -> None:
        self._shown = dict(call)
        name = str(call.get("name", "?"))
        server = call.get("server")
        where = f" <span style='color:{theme.MUTED}'>({_html(str(server))})</span>" if server else ""
        self.title.setText(f"<b>🔧 {_html(name)}</b>{where}")
        self.arguments.setText(
            f"<span style='color:{theme.MUTED}'>arguments</span><pre>{_html(pretty_arguments(str(call.get('arguments', ''))))}</pre>"
        )
        self.allow_button.setText(f"Always allow {name} here")
        self.allow_button.setToolTip(f"Run this call, and every call of {name} in this chat without asking")
        status = str(call.get("status", "pending"))
        colour = STATUS_COLOURS.get(status, theme.TEXT)
        words = STATUS_WORDS.get(status, status)
        if call.get("seconds"):
            words += f" in {float(call['seconds']):.2f} s"
        size = int(call.get("size") or 0)
        if call.get("truncated"):
            words += f" · it returned {size:,} characters; the model is given the first part"
        self.status.setText(f"<span style='color:{colour}'>● {_html(words)}</span>")
        pending = status == "pending"
        for button in (self.run_button, self.allow_button, self.deny_button):
            button.setVisible(pending)
        self._show_result()
        blocks = call.get("blocks")
        if isinstance(blocks, list) and blocks:
            tokens = call.get("result_tokens") or [0, 0]
            self.blocks.setText(
                f"the result's {tokens[1] - tokens[0]} tokens (prompt positions {tokens[0]}–{tokens[1] - 1}) are in "
                f"{len(blocks)} KV block{'s' if len(blocks) != 1 else ''}: #{', #'.join(str(b) for b in blocks)}"
            )
            self.blocks.show()
        elif call.get("blocks_note"):
            self.blocks.setText(str(call["blocks_note"]))
            self.blocks.show()
        else:
            self.blocks.hide()

    def _show_result(self) -> None:
        text = str(self._shown.get("result") or "")
        if not text:
            self.result.hide()
            self.more.hide()
            return
        long = len(text) > RESULT_PREVIEW_CHARS
        shown = text if (self.more.isChecked() or not long) else text[:RESULT_PREVIEW_CHARS] + " …"
        self.result.setText(f"<pre>{_html(shown)}</pre>")
        self.result.show()
        self.more.setVisible(long)


def raw_tokens_html(pieces: list[str], fallback: str) -> str:
    """The call's tokens as the model wrote them, one · between tokens (its text when the
    tokens are not known here)."""
    if not pieces:
        return f"<code style='white-space: pre-wrap'>{_html(fallback)}</code>"
    sep = f"<span style='color:{theme.MUTED}'>·</span>"
    return f"<code style='white-space: pre-wrap'>{sep.join(_html(p) for p in pieces)}</code>"
