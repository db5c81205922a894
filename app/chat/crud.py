"""The chat's conversations: new, open, rename, delete, export, import, the sidebar's list and its
search hits."""

from __future__ import annotations

from pathlib import Path

from app.chat.chat_options import ChatOptions
from app.chat.conversation_list import ConversationList
from app.chat.conversations import ConversationStore, StorageError
from app.chat.exchange import export_json, export_markdown, import_json
from app.chat.session import ChatSession, ChatSignals, set_editing
from app.chat.transcript import Transcript
from app.chat.view import ChatPane

EXPORT_FORMATS = ("markdown", "json", "json-path")  # the visible path as Markdown, the tree, the path


class ConversationActions:
    def __init__(
        self,
        pane: ChatPane,
        sidebar: ConversationList,
        store: ConversationStore,
        session: ChatSession,
        signals: ChatSignals,
        transcript: Transcript,
        options: ChatOptions,
    ) -> None:
        self.pane, self.sidebar, self.store, self.session, self.signals = (
            pane,
            sidebar,
            store,
            session,
            signals,
        )
        self.transcript, self.options = transcript, options

    def new_conversation(self) -> None:
        session = self.session
        if session.busy:
            return
        session.conversation = None
        self.pane.transcript.clear()
        self.options.load()  # a new chat keeps the setting shown until it is saved
        set_editing(session, self.pane, None)
        self.pane.input.clear()
        self.refresh_sidebar()
        self.signals.sync()
        self.signals.measure()

    def open_conversation(self, conversation_id: int, leaf_id: int | None = None) -> None:
        """Show a stored conversation (at `leaf_id`'s path when given, else where it was left)."""
        session = self.session
        same = session.conversation is not None and session.conversation.id == conversation_id
        if session.busy or (same and leaf_id is None):
            return
        conv = self.store.load(conversation_id)
        if conv is None:
            self.signals.status(f"Conversation {conversation_id} no longer exists.", "error")
            self.refresh_sidebar()
            return
        session.conversation = conv
        if leaf_id is not None and leaf_id in conv.nodes:
            self.transcript.show_leaf(leaf_id)
        self.pane.set_system_prompt(conv.system_prompt)
        self.options.load()
        set_editing(session, self.pane, None)
        self.transcript.render()
        self.refresh_sidebar()
        self.signals.sync()
        self.signals.measure()

    def open_message(self, conversation_id: int, message_id: int) -> None:
        """A search hit: open its conversation on a path through that message."""
        current = self.session.conversation
        conv = current if current is not None and current.id == conversation_id else None
        conv = conv or self.store.load(conversation_id)
        if conv is None or message_id not in conv.nodes:
            self.signals.status("That message no longer exists.", "error")
            return
        if self.session.conversation is conv:
            self.transcript.show_leaf(conv.newest_leaf(message_id))
            self.transcript.render()
            self.signals.measure()
        else:
            self.open_conversation(conversation_id, conv.newest_leaf(message_id))
        bubble = next((b for b in self.pane.transcript.bubbles if b.message_id == message_id), None)
        if bubble is not None:
            self.pane.transcript.ensureWidgetVisible(bubble)

    def search(self, text: str) -> None:
        """The sidebar's search: every message of every conversation holding the words."""
        self.sidebar.show_hits(self.store.search(text))

    def open_latest(self) -> None:
        summaries = self.store.summaries()
        if summaries:
            self.open_conversation(summaries[0].id)

    def refresh_sidebar(self) -> None:
        conv = self.session.conversation
        self.sidebar.set_conversations(self.store.summaries(), conv.id if conv else None)

    def rename(self, conversation_id: int, title: str) -> None:
        title = " ".join(title.split())
        if not title:
            return
        self.store.rename(conversation_id, title)
        conv = self.session.conversation
        if conv is not None and conv.id == conversation_id:
            conv.title = title
        self.refresh_sidebar()

    def delete(self, conversation_id: int) -> None:
        conv = self.session.conversation
        current = conv is not None and conv.id == conversation_id
        if self.session.busy and current:
            self.signals.status("Stop the reply before deleting its conversation.", "error")
            return
        self.store.delete(conversation_id)
        if current:
            self.new_conversation()
        self.refresh_sidebar()

    def export_to(self, conversation_id: int, fmt: str, path: Path) -> None:
        """Markdown of the visible path, JSON of the whole tree ("json") or of the path."""
        conv = self.store.load(conversation_id)
        if conv is None:
            raise StorageError(f"Conversation {conversation_id} no longer exists.")
        shown = self.session.conversation
        if shown is not None and shown.id == conversation_id:
            conv.show(shown.leaf_id)  # the path on screen, even mid-stream
        if fmt == "markdown":
            text = export_markdown(conv)
        else:
            text = export_json(conv, scope="path" if fmt == "json-path" else "tree")
        Path(path).write_text(text, encoding="utf-8")

    def import_from(self, path: Path) -> int:
        """Store an exported conversation and open it; ImportFailed / OSError say why not."""
        conversation_id = import_json(self.store, Path(path).read_text(encoding="utf-8"))
        self.refresh_sidebar()
        if not self.session.busy:
            self.open_conversation(conversation_id)
        return conversation_id
