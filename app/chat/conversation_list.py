"""The sidebar of past conversations: newest first, with new / rename / export / delete, and a
search box over every message of every conversation and branch (SQLite FTS5): while it holds
text the list shows the matching messages instead, and choosing one opens its conversation on
the path through it."""

from __future__ import annotations

import time

from PySide6.QtCore import QPoint, Qt, Signal, Slot
from PySide6.QtWidgets import (
    QLabel,
    QLineEdit,
    QListWidget,
    QListWidgetItem,
    QMenu,
    QPushButton,
    QVBoxLayout,
    QWidget,
)

from app.chat.conversations import ConversationSummary, SearchHit

HIT_ROLE = Qt.ItemDataRole.UserRole + 1  # a search hit's message id (UserRole: its conversation)


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


def _plain(snippet_html: str) -> str:
    return (
        snippet_html.replace("<b>", "«")
        .replace("</b>", "»")
        .replace("&lt;", "<")
        .replace("&gt;", ">")
        .replace("&quot;", '"')
        .replace("&#x27;", "'")
        .replace("&amp;", "&")
    )


class ConversationList(QWidget):
    new_requested = Signal()
    chosen = Signal(int)
    rename_requested = Signal(int)
    export_requested = Signal(int, str)  # conversation id, "markdown" | "json" | "json-path"
    delete_requested = Signal(int)
    search_changed = Signal(str)
    hit_chosen = Signal(int, int)  # conversation id, message id

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("conversationList")
        self.new_button = QPushButton("+  New conversation")
        self.new_button.setObjectName("newConversation")
        self.new_button.clicked.connect(self.new_requested)
        self.search = QLineEdit()
        self.search.setObjectName("searchBox")
        self.search.setPlaceholderText("Search all conversations…")
        self.search.setClearButtonEnabled(True)
        self.search.setToolTip("Every word must occur; the last one may be the start of a word")
        self.search.textChanged.connect(self._on_search_text)
        self.search_note = QLabel("")
        self.search_note.setObjectName("hint")
        self.search_note.hide()
        self.list = QListWidget()
        self.list.setMinimumHeight(40)  # two rows at the least: a 540 px screen still fits the column
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
        layout.addWidget(self.search)
        layout.addWidget(self.search_note)
        layout.addWidget(self.list, 1)
        self._populating = False
        self._summaries: list[ConversationSummary] = []
        self._current_id: int | None = None

    @property
    def searching(self) -> bool:
        return bool(self.search.text().strip())

    def set_conversations(self, summaries: list[ConversationSummary], current_id: int | None) -> None:
        self._summaries, self._current_id = summaries, current_id
        if not self.searching:
            self._show_conversations()

    def _show_conversations(self) -> None:
        self._populating = True
        try:
            self.list.clear()
            self.search_note.hide()
            now = time.time()
            for s in self._summaries:
                item = QListWidgetItem(
                    f"{s.title}\n{s.message_count} messages · {age_label(s.updated_at, now)}"
                )
                item.setData(Qt.ItemDataRole.UserRole, s.id)
                item.setToolTip(s.title)
                self.list.addItem(item)
                if s.id == self._current_id:
                    self.list.setCurrentItem(item)
        finally:
            self._populating = False

    def show_hits(self, hits: list[SearchHit]) -> None:
        """The messages matching the search, best first (one row per message)."""
        self._populating = True
        try:
            self.list.clear()
            for hit in hits:
                who = "You" if hit.role == "user" else "Reply"
                item = QListWidgetItem(f"{hit.title}\n{who}: {_plain(hit.snippet)}")
                item.setData(Qt.ItemDataRole.UserRole, hit.conversation_id)
                item.setData(HIT_ROLE, hit.message_id)
                item.setToolTip(f"<b>{hit.title}</b><br>{hit.snippet}")
                self.list.addItem(item)
        finally:
            self._populating = False
        self.search_note.setText(
            f"{len(hits)} message{'s' if len(hits) != 1 else ''} found" if hits else "Nothing found"
        )
        self.search_note.show()

    def ids(self) -> list[int]:
        return [self.list.item(i).data(Qt.ItemDataRole.UserRole) for i in range(self.list.count())]

    @Slot(str)
    def _on_search_text(self, text: str) -> None:
        if text.strip():
            self.search_changed.emit(text)
        else:
            self._show_conversations()

    @Slot(QListWidgetItem, QListWidgetItem)
    def _on_current_changed(self, current: QListWidgetItem | None, _previous: QListWidgetItem | None) -> None:
        if current is None or self._populating:
            return
        message_id = current.data(HIT_ROLE)
        if message_id is not None:
            self.hit_chosen.emit(current.data(Qt.ItemDataRole.UserRole), message_id)
        else:
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
        export_json = menu.addAction("Export as JSON (every branch)…")
        export_path = menu.addAction("Export the shown path as JSON…")
        menu.addSeparator()
        delete = menu.addAction("Delete")
        picked = menu.exec(self.list.mapToGlobal(pos))
        if picked is rename:
            self.rename_requested.emit(conv_id)
        elif picked is export_md:
            self.export_requested.emit(conv_id, "markdown")
        elif picked is export_json:
            self.export_requested.emit(conv_id, "json")
        elif picked is export_path:
            self.export_requested.emit(conv_id, "json-path")
        elif picked is delete:
            self.delete_requested.emit(conv_id)
