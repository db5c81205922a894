"""The main window's conversation actions: File › export (Markdown of the shown path, JSON of the
whole tree or of the path) and import, the sidebar's rename / export / delete, Chat › At the
context limit, and "continue from here" in the probability panel routed to the chat tab whose
reply holds that token. Kept out of app.window so the window stays about layout."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from PySide6.QtCore import QObject, Slot
from PySide6.QtGui import QAction, QActionGroup
from PySide6.QtWidgets import QFileDialog, QInputDialog, QMenu, QMessageBox, QWidget

from app.chat.context_fit import POLICY_LABELS
from app.chat.controller import ChatController
from app.chat.conversation_list import ConversationList
from app.chat.conversations import ConversationStore, StorageError
from app.chat.exchange import ImportFailed
from app.chat.tabs import ChatTabs
from app.engine_calls import EngineCalls
from app.engine_host import EngineHost
from app.settings import AppSettings
from app.status_bar import StatusBar
from app.token_entries import EntryError, ResolvedEntry, TokenEntry, pieces, resolve
from engine.api import Tokens
from widgets.probability_panel import ProbabilityPanel

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
    """Given what it acts through: the window only as the parent of its dialogs and actions, the
    host (its tokenizer questions), the sidebar, the probability panel, the settings, the chat
    tabs and the first tab's controller (the chat the menus act on), the store and the status bar."""

    def __init__(
        self,
        dialogs: QWidget,
        host: EngineHost,
        sidebar: ConversationList,
        probabilities: ProbabilityPanel,
        settings: AppSettings,
        tabs: ChatTabs,
        controller: ChatController,
        store: ConversationStore,
        status: StatusBar,
    ) -> None:
        super().__init__(dialogs)
        self.dialogs, self.settings, self.tabs, self.controller = dialogs, settings, tabs, controller
        self.store, self.status = store, status
        self.policy_actions = QActionGroup(self)
        self.calls = EngineCalls(host, self)
        sidebar.rename_requested.connect(self.rename)
        sidebar.export_requested.connect(self.export)
        sidebar.delete_requested.connect(self.delete)
        probabilities.continue_requested.connect(self.continue_from)

    # ---- menus -------------------------------------------------------------------------------
    def fill_file_menu(self, menu: QMenu) -> None:
        for text, fmt in (
            ("Export as &Markdown…", "markdown"),
            ("Export as &JSON (every branch)…", "json"),
            ("Export the shown &path as JSON…", "json-path"),
        ):
            action = QAction(text, self.dialogs)
            action.triggered.connect(lambda _=False, f=fmt: self.export_current(f))
            menu.addAction(action)
        action = QAction("&Import conversation…", self.dialogs)
        action.triggered.connect(self.import_file)
        menu.addAction(action)

    def fill_chat_menu(self, menu: QMenu) -> None:
        menu.addSeparator()
        limit_menu = menu.addMenu("At the context &limit")
        limit_menu.setToolTipsVisible(True)
        current = self.settings.context_policy()
        for policy, label in POLICY_LABELS.items():
            action = limit_menu.addAction(label)
            action.setCheckable(True)
            action.setChecked(policy == current)
            action.setData(policy)
            action.triggered.connect(lambda _=False, p=policy: self.set_context_policy(p))
            self.policy_actions.addAction(action)

    # ---- typed logit bias and bans -------------------------------------------------------------
    def resolve_tokens(
        self,
        entries: Sequence[TokenEntry],
        on_result: Callable[[list[ResolvedEntry]], None],
        on_error: Callable[[str], None] | None,
    ) -> bool:
        """The sampling controls' entries as the running model's tokens (engine thread)."""

        def resolved(tokens: list[Tokens]) -> None:
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
        self.settings.set_context_policy(policy)
        for action in self.policy_actions.actions():
            action.setChecked(action.data() == policy)
        for controller in self.tabs.controllers:
            controller.schedule_measure()

    # ---- branching from the probability panel ---------------------------------------------------
    @Slot(int, int, int)
    def continue_from(self, request_id: int, index: int, token_id: int) -> None:
        tabs = self.tabs
        controller = tabs.controller_for_request(request_id) or self.controller
        tabs.setCurrentIndex(tabs.controllers.index(controller))
        controller.branch_from_token(request_id, index, token_id)

    # ---- export, import, rename, delete -----------------------------------------------------------
    def _current_id(self) -> int | None:
        conv = self.controller.conversation
        return conv.id if conv else None

    def export_current(self, fmt: str) -> None:
        current = self._current_id()
        if current is not None:
            self.export(current, fmt)

    @Slot(int, str)
    def export(self, conversation_id: int, fmt: str) -> None:
        suffix, kind = EXPORT_KINDS[fmt]
        conv = self.store.load(conversation_id)
        if conv is None:
            return
        stem = "".join(c if c.isalnum() or c in " -_" else "_" for c in conv.title).strip() or "conversation"
        path, _ = QFileDialog.getSaveFileName(
            self.dialogs, "Export conversation", str(Path.home() / (stem + suffix)), kind
        )
        if not path:
            return
        try:
            self.controller.export_to(conversation_id, fmt, Path(path))
        except (OSError, StorageError) as exc:
            self.status.show_error(f"Export failed: {exc}")
            return
        self.status.showMessage(f"Exported to {path}", 5000)

    @Slot()
    def import_file(self) -> None:
        path, _ = QFileDialog.getOpenFileName(
            self.dialogs, "Import conversation", str(Path.home()), "JSON (*.json)"
        )
        if path:
            self.import_path(Path(path))

    def import_path(self, path: Path) -> bool:
        try:
            self.controller.import_from(path)
        except (OSError, UnicodeDecodeError, ImportFailed, StorageError) as exc:
            self.status.show_error(f"Import failed: {exc}")
            return False
        self.status.showMessage(f"Imported {path}", 5000)
        return True

    @Slot(int)
    def rename(self, conversation_id: int) -> None:
        conv = self.store.load(conversation_id)
        if conv is None:
            return
        title, ok = QInputDialog.getText(self.dialogs, "Rename conversation", "Title:", text=conv.title)
        if ok:
            self.controller.rename(conversation_id, title)

    @Slot(int)
    def delete(self, conversation_id: int) -> None:
        answer = QMessageBox.question(
            self.dialogs,
            "Delete conversation",
            "Delete this conversation and all its messages, every branch?",
        )
        if answer == QMessageBox.StandardButton.Yes:
            self.controller.delete(conversation_id)
