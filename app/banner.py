"""A one-line notice across the top of the chat with an optional action: the conversation
database opened read-only, a remote engine that stopped answering (Reattach)."""

from __future__ import annotations

from collections.abc import Callable

from PySide6.QtCore import Slot
from PySide6.QtWidgets import QFrame, QHBoxLayout, QLabel, QPushButton, QWidget


class Banner(QFrame):
    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("banner")
        self.setFrameShape(QFrame.Shape.StyledPanel)
        self.label = QLabel()
        self.label.setWordWrap(True)
        self.action = QPushButton()
        self.action.clicked.connect(self._on_action)
        self.close_button = QPushButton("Dismiss")
        self.close_button.clicked.connect(self.hide)
        row = QHBoxLayout(self)
        row.setContentsMargins(8, 4, 8, 4)
        row.addWidget(self.label, 1)
        row.addWidget(self.action)
        row.addWidget(self.close_button)
        self._callback: Callable[[], None] | None = None
        self.hide()

    def show_message(
        self, text: str, action: str | None = None, on_action: Callable[[], None] | None = None
    ) -> None:
        self.label.setText(text)
        self._callback = on_action
        self.action.setText(action or "")
        self.action.setVisible(bool(action and on_action))
        self.show()

    @property
    def text(self) -> str:
        return self.label.text() if self.isVisible() else ""

    @Slot()
    def _on_action(self) -> None:
        callback = self._callback
        self.hide()
        if callback is not None:
            callback()
