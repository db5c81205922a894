"""The sidebar of past conversations: newest first, with new / rename / export / delete."""

from __future__ import annotations

import time

from PySide6.QtCore import QPoint, Qt, Signal, Slot
from PySide6.QtWidgets import QListWidget, QListWidgetItem, QMenu, QPushButton, QVBoxLayout, QWidget

from app.chat.conversations import ConversationSummary


def age_label(updated_at: float, now: float) -> str:
    """'just now', '5 min ago', '3 h ago', or the date: enough to find yesterday's chat."""
    seconds = max(0.0, now - updated_at)
    if seconds < 60:
        return "just now"
    if seconds < 3600:
        return f"{int(seconds // 60)} min ago"
    if seconds < 86400:
        return f"{int(seconds // 3600)} h ago"
    return time.strftime("%Y-%m-%d", time.localtime(updated_at))


class ConversationList(QWidget):
    new_requested = Signal()
    chosen = Signal(int)
    rename_requested = Signal(int)
    export_requested = Signal(int, str)  # conversation id, "markdown" | "json"
    delete_requested = Signal(int)

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("conversationList")
        self.new_button = QPushButton("+  New conversation")
        self.new_button.setObjectName("newConversation")
        self.new_button.clicked.connect(self.new_requested)
        self.list = QListWidget()
        self.list.setObjectName("conversations")
        self.list.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.list.setTextElideMode(Qt.TextElideMode.ElideRight)
        self.list.setUniformItemSizes(True)
        self.list.setContextMenuPolicy(Qt.ContextMenuPolicy.CustomContextMenu)
        self.list.customContextMenuRequested.connect(self._on_context_menu)
        self.list.currentItemChanged.connect(self._on_current_changed)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(6, 6, 6, 6)
        layout.addWidget(self.new_button)
        layout.addWidget(self.list, 1)
        self._populating = False

    def set_conversations(self, summaries: list[ConversationSummary], current_id: int | None) -> None:
        self._populating = True
        try:
            self.list.clear()
            now = time.time()
            for s in summaries:
                item = QListWidgetItem(
                    f"{s.title}\n{s.message_count} messages · {age_label(s.updated_at, now)}"
                )
                item.setData(Qt.ItemDataRole.UserRole, s.id)
                item.setToolTip(s.title)
                self.list.addItem(item)
                if s.id == current_id:
                    self.list.setCurrentItem(item)
        finally:
            self._populating = False

    def ids(self) -> list[int]:
        return [self.list.item(i).data(Qt.ItemDataRole.UserRole) for i in range(self.list.count())]

    @Slot(QListWidgetItem, QListWidgetItem)
    def _on_current_changed(self, current: QListWidgetItem | None, _previous) -> None:
        if current is not None and not self._populating:
            self.chosen.emit(current.data(Qt.ItemDataRole.UserRole))

    @Slot(QPoint)
    def _on_context_menu(self, pos: QPoint) -> None:
        item = self.list.itemAt(pos)
        if item is None:
            return
        conv_id = item.data(Qt.ItemDataRole.UserRole)
        menu = QMenu(self)
        rename = menu.addAction("Rename…")
        export_md = menu.addAction("Export as Markdown…")
        export_json = menu.addAction("Export as JSON…")
        menu.addSeparator()
        delete = menu.addAction("Delete")
        picked = menu.exec(self.list.mapToGlobal(pos))
        if picked is rename:
            self.rename_requested.emit(conv_id)
        elif picked is export_md:
            self.export_requested.emit(conv_id, "markdown")
        elif picked is export_json:
            self.export_requested.emit(conv_id, "json")
        elif picked is delete:
            self.delete_requested.emit(conv_id)
