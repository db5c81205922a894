"""The main window's conversation actions: File › export (Markdown of the shown path, JSON of the
whole tree or of the path) and import, the sidebar's rename / export / delete, Chat › At the
context limit, and "continue from here" in the probability panel routed to the chat tab whose
reply holds that token. Kept out of app.window so the window stays about layout."""

from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import QObject, Slot
from PySide6.QtGui import QAction, QActionGroup
from PySide6.QtWidgets import QFileDialog, QInputDialog, QMessageBox

from app.chat.context_fit import POLICY_LABELS
from app.chat.conversations import ConversationStore, StorageError
from app.chat.exchange import ImportFailed
from app.engine_calls import EngineCalls
from app.token_entries import EntryError, pieces, resolve

EXPORT_KINDS = {
    "markdown": (".md", "Markdown (*.md)"),
    "json": (".json", "JSON (*.json)"),
    "json-path": (".json", "JSON (*.json)"),
}


def mark_interrupted(conversations: ConversationStore) -> int:
    """Replies a crash or a kill left streaming: marked interrupted (how many)."""
    try:
        return conversations.mark_interrupted()
    except StorageError:
        return 0  # a read-only database still opens; its replies just stay as they are


class ChatWindowActions(QObject):
    def __init__(self, window) -> None:
        super().__init__(window)
        self.window = window
        self.policy_actions = QActionGroup(self)
        self.calls = EngineCalls(window.host, self)
        sidebar = window.sidebar
        sidebar.rename_requested.connect(self.rename)
        sidebar.export_requested.connect(self.export)
        sidebar.delete_requested.connect(self.delete)
        window.panels.probabilities.continue_requested.connect(self.continue_from)

    # ---- menus -------------------------------------------------------------------------------
    def fill_file_menu(self, menu) -> None:
        for text, fmt in (
            ("Export as &Markdown…", "markdown"),
            ("Export as &JSON (every branch)…", "json"),
            ("Export the shown &path as JSON…", "json-path"),
        ):
            action = QAction(text, self.window)
            action.triggered.connect(lambda _=False, f=fmt: self.export_current(f))
            menu.addAction(action)
        action = QAction("&Import conversation…", self.window)
        action.triggered.connect(self.import_file)
        menu.addAction(action)

    def fill_chat_menu(self, menu) -> None:
        menu.addSeparator()
        limit_menu = menu.addMenu("At the context &limit")
        limit_menu.setToolTipsVisible(True)
        current = self.window.settings.context_policy()
        for policy, label in POLICY_LABELS.items():
            action = limit_menu.addAction(label)
            action.setCheckable(True)
            action.setChecked(policy == current)
            action.setData(policy)
            action.triggered.connect(lambda _=False, p=policy: self.set_context_policy(p))
            self.policy_actions.addAction(action)

    # ---- typed logit bias and bans -------------------------------------------------------------
    def resolve_tokens(self, entries, on_result, on_error) -> bool:
        """The sampling controls' entries as the running model's tokens (engine thread)."""

        def resolved(tokens) -> None:
            try:
                answer = resolve(entries, tokens)
            except EntryError as exc:
                if on_error is not None:
                    on_error(str(exc))
                return
            on_result(answer)

        return self.calls.ask(lambda engine: engine.tokens_of(pieces(entries)), resolved, on_error)

    # ---- the context limit ---------------------------------------------------------------------
    def set_context_policy(self, policy: str) -> None:
        """At the context limit: drop the oldest turns (marked) or refuse to send."""
        self.window.settings.set_context_policy(policy)
        for action in self.policy_actions.actions():
            action.setChecked(action.data() == policy)
        for controller in self.window.chat_tabs.controllers:
            controller.schedule_measure()

    # ---- branching from the probability panel ---------------------------------------------------
    @Slot(int, int, int)
    def continue_from(self, request_id: int, index: int, token_id: int) -> None:
        tabs = self.window.chat_tabs
        controller = tabs.controller_for_request(request_id) or self.window.controller
        tabs.setCurrentIndex(tabs.controllers.index(controller))
        controller.branch_from_token(request_id, index, token_id)

    # ---- export, import, rename, delete -----------------------------------------------------------
    def _current_id(self) -> int | None:
        conv = self.window.controller.conversation
        return conv.id if conv else None

    def export_current(self, fmt: str) -> None:
        if self._current_id() is not None:
            self.export(self._current_id(), fmt)

    @Slot(int, str)
    def export(self, conversation_id: int, fmt: str) -> None:
        window = self.window
        suffix, kind = EXPORT_KINDS[fmt]
        conv = window.conversations.load(conversation_id)
        if conv is None:
            return
        stem = "".join(c if c.isalnum() or c in " -_" else "_" for c in conv.title).strip() or "conversation"
        path, _ = QFileDialog.getSaveFileName(
            window, "Export conversation", str(Path.home() / (stem + suffix)), kind
        )
        if not path:
            return
        try:
            window.controller.export_to(conversation_id, fmt, Path(path))
        except (OSError, StorageError) as exc:
            window.status.show_error(f"Export failed: {exc}")
            return
        window.status.showMessage(f"Exported to {path}", 5000)

    @Slot()
    def import_file(self) -> None:
        window = self.window
        path, _ = QFileDialog.getOpenFileName(
            window, "Import conversation", str(Path.home()), "JSON (*.json)"
        )
        if path:
            self.import_path(Path(path))

    def import_path(self, path: Path) -> bool:
        window = self.window
        try:
            window.controller.import_from(path)
        except (OSError, UnicodeDecodeError, ImportFailed, StorageError) as exc:
            window.status.show_error(f"Import failed: {exc}")
            return False
        window.status.showMessage(f"Imported {path}", 5000)
        return True

    @Slot(int)
    def rename(self, conversation_id: int) -> None:
        window = self.window
        conv = window.conversations.load(conversation_id)
        if conv is None:
            return
        title, ok = QInputDialog.getText(window, "Rename conversation", "Title:", text=conv.title)
        if ok:
            window.controller.rename(conversation_id, title)

    @Slot(int)
    def delete(self, conversation_id: int) -> None:
        answer = QMessageBox.question(
            self.window,
            "Delete conversation",
            "Delete this conversation and all its messages, every branch?",
        )
        if answer == QMessageBox.StandardButton.Yes:
            self.window.controller.delete(conversation_id)
