"""The chat's behaviour: turns user actions into engine requests and stored messages, and the
engine's tokens into a streaming reply that is saved as it grows.

Owns the current conversation (None until its first message, so opening the app does not pile
up empty conversations), the reply in flight and the token selection shown in the
probability panel.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from PySide6.QtCore import QObject, Signal, Slot

from app.chat_view import ChatPane, MessageBubble
from app.conversation_list import ConversationList
from app.conversations import (
    DEFAULT_TITLE,
    Conversation,
    ConversationStore,
    ReplyCheckpoint,
    StorageError,
    StoredMessage,
    export_json,
    export_markdown,
    title_from,
)
from app.engine_host import EngineHost
from app.prefix_ttft import first_uncached, prefix_cache_note
from app.rich_text import ReplyToken
from engine.config import ConfigError, SamplingParams
from engine.events import RequestFailed, RequestFinished, RequestStats, TokenGenerated
from engine.request import ChatMessage, Request

USER_AUTHOR = "You"
FINISH_LABELS = {
    "stop": "",
    "length": "stopped at the token limit",
    "cancelled": "stopped",
    "failed": "failed",
}


@dataclass(slots=True)
class ReplyRecord:
    """A reply generated in this session: which engine and request made it, and its tokens."""

    generation: int
    request_id: int
    tokens: list[ReplyToken] = field(default_factory=list)
    stats: RequestStats | None = None


@dataclass(slots=True)
class ActiveReply:
    message: StoredMessage
    bubble: MessageBubble
    checkpoint: ReplyCheckpoint
    record: ReplyRecord
    text: str = ""


def reply_meta(
    finish_reason: str | None, stats: RequestStats | None, uncached: RequestStats | None = None
) -> str:
    """The reply header; `uncached` is the conversation's earlier uncached turn, shown beside a
    TTFT that the prefix cache shortened."""
    parts = []
    if stats is not None and stats.generated_tokens:
        parts.append(f"{stats.generated_tokens} tokens")
        if stats.tokens_per_s > 0:
            parts.append(f"{stats.tokens_per_s:.1f} tok/s")
        note = prefix_cache_note(stats, uncached)
        parts.append(f"TTFT {stats.ttft_s * 1000:.0f} ms" + (f" ({note})" if note else ""))
    label = FINISH_LABELS.get(finish_reason or "", finish_reason or "")
    if label:
        parts.append(label)
    return " · ".join(parts)


class ChatController(QObject):
    token_inspected = Signal(object, object)  # request id | None, token index | None
    status_message = Signal(str, str)  # text, kind: "error" | "info"

    def __init__(
        self,
        pane: ChatPane,
        sidebar: ConversationList,
        store: ConversationStore,
        host: EngineHost,
        sampling: Callable[[], SamplingParams],
        parent: QObject | None = None,
    ):
        super().__init__(parent)
        self.pane, self.sidebar, self.store, self.host = pane, sidebar, store, host
        self._sampling = sampling
        self.conversation: Conversation | None = None
        self.active: ActiveReply | None = None
        self._records: dict[int, ReplyRecord] = {}  # message id -> this session's reply data
        self._pinned: tuple[int, int] | None = None  # (request id, token index)
        self._pinned_bubble: MessageBubble | None = None

        pane.send_requested.connect(self.send)
        pane.stop_requested.connect(self.stop)
        pane.regenerate_requested.connect(self.regenerate)
        pane.edit_requested.connect(self.edit_last)
        pane.edit_cancelled.connect(self.cancel_edit)
        pane.system_prompt_edited.connect(self._on_system_prompt_edited)
        sidebar.new_requested.connect(self.new_conversation)
        sidebar.chosen.connect(self.open_conversation)
        host.tokens_generated.connect(self._on_tokens)
        host.request_finished.connect(self._on_finished)
        host.request_failed.connect(self._on_failed)
        host.status_changed.connect(self.sync_state)
        self.refresh_sidebar()
        self.sync_state()

    # ---- conversations ---------------------------------------------------------------------
    @Slot()
    def new_conversation(self) -> None:
        if self.active is not None:
            return
        self.conversation = None
        self.pane.transcript.clear()
        self.pane.set_editing(None)
        self.pane.input.clear()
        self.refresh_sidebar()
        self.sync_state()

    @Slot(int)
    def open_conversation(self, conversation_id: int) -> None:
        if self.active is not None or (self.conversation and self.conversation.id == conversation_id):
            return
        conv = self.store.load(conversation_id)
        if conv is None:
            self.status_message.emit(f"Conversation {conversation_id} no longer exists.", "error")
            self.refresh_sidebar()
            return
        self.conversation = conv
        self.pane.set_system_prompt(conv.system_prompt)
        self.pane.set_editing(None)
        self._render_transcript()
        self.refresh_sidebar()
        self.sync_state()

    def open_latest(self) -> None:
        summaries = self.store.summaries()
        if summaries:
            self.open_conversation(summaries[0].id)

    def refresh_sidebar(self) -> None:
        current = self.conversation.id if self.conversation else None
        self.sidebar.set_conversations(self.store.summaries(), current)

    def rename(self, conversation_id: int, title: str) -> None:
        title = " ".join(title.split())
        if not title:
            return
        self.store.rename(conversation_id, title)
        if self.conversation and self.conversation.id == conversation_id:
            self.conversation.title = title
        self.refresh_sidebar()

    def delete(self, conversation_id: int) -> None:
        if self.active is not None and self.conversation and self.conversation.id == conversation_id:
            self.status_message.emit("Stop the reply before deleting its conversation.", "error")
            return
        self.store.delete(conversation_id)
        if self.conversation and self.conversation.id == conversation_id:
            self.new_conversation()
        self.refresh_sidebar()

    def export_to(self, conversation_id: int, fmt: str, path: Path) -> None:
        conv = self.store.load(conversation_id)
        if conv is None:
            raise StorageError(f"Conversation {conversation_id} no longer exists.")
        text = export_markdown(conv) if fmt == "markdown" else export_json(conv)
        Path(path).write_text(text, encoding="utf-8")

    def _render_transcript(self) -> None:
        self._unpin()
        self.pane.transcript.clear()
        for msg in self.conversation.messages if self.conversation else []:
            bubble = self._add_bubble(msg)
            record = self._records.get(msg.id)
            if msg.role == "assistant":
                bubble.set_meta(reply_meta(msg.finish_reason, record.stats if record else None))

    def _add_bubble(self, msg: StoredMessage) -> MessageBubble:
        author = USER_AUTHOR if msg.role == "user" else (msg.model or "Assistant")
        record = self._records.get(msg.id)
        bubble = MessageBubble(msg.role, author, record.request_id if record else None)
        bubble.set_view(*self.pane.view_flags())
        if record is not None and record.generation == self.host.generation:
            bubble.add_tokens(record.tokens, msg.content)
        else:
            bubble.set_text(msg.content)
        bubble.token_hovered.connect(self._on_token_hovered)
        bubble.token_clicked.connect(self._on_token_clicked)
        return self.pane.transcript.add(bubble)

    # ---- sending ---------------------------------------------------------------------------
    @Slot(str)
    def send(self, text: str) -> None:
        if self.active is not None or not self.host.status().ready:
            return
        try:
            if self.conversation is None:
                self.conversation = self.store.create(self.pane.system_prompt.toPlainText())
            conv = self.conversation
            if self.pane.editing:
                self._drop_from_last_user_message()
            if conv.title == DEFAULT_TITLE and not conv.messages:
                conv.title = title_from(text)
                self.store.rename(conv.id, conv.title)
            msg = self.store.add_message(conv.id, "user", text)
        except StorageError as exc:
            self.status_message.emit(str(exc), "error")
            return
        conv.messages.append(msg)
        self._add_bubble(msg)
        self.pane.set_editing(None)
        self.pane.input.clear()
        self._start_reply()

    @Slot()
    def regenerate(self) -> None:
        conv = self.conversation
        if self.active is not None or conv is None or not conv.messages:
            return
        if conv.messages[-1].role == "assistant":
            self._drop_messages_from(len(conv.messages) - 1)
        self._start_reply()

    @Slot()
    def edit_last(self) -> None:
        last = self._last_user_index()
        if self.active is None and last is not None:
            self.pane.set_editing(self.conversation.messages[last].content)
            self.sync_state()

    @Slot()
    def cancel_edit(self) -> None:
        if self.pane.editing:
            self.pane.set_editing(None)
            self.pane.input.clear()
            self.sync_state()

    @Slot()
    def stop(self) -> None:
        if self.active is not None:
            self.host.cancel(self.active.record.request_id)

    def _start_reply(self) -> None:
        conv = self.conversation
        history = tuple(ChatMessage(m.role, m.content) for m in conv.messages if m.content)
        system = self.pane.system_prompt.toPlainText().strip()
        messages = ((ChatMessage("system", system),) if system else ()) + history
        try:
            request_id = self.host.submit(Request(messages=messages, sampling=self._sampling()))
            msg = self.store.add_message(conv.id, "assistant", "", model=self.host.model_name)
        except (RuntimeError, ConfigError, StorageError) as exc:
            self.status_message.emit(f"Could not start the reply: {exc}", "error")
            self.sync_state()
            return
        conv.messages.append(msg)
        record = ReplyRecord(self.host.generation, request_id)
        self._records[msg.id] = record
        bubble = self._add_bubble(msg)
        bubble.set_meta("generating…", "live")
        self.active = ActiveReply(msg, bubble, ReplyCheckpoint(self.store, msg.id), record)
        self._unpin()
        self.token_inspected.emit(None, None)  # follow the newest token
        self.refresh_sidebar()
        self.sync_state()

    def _last_user_index(self) -> int | None:
        msgs = self.conversation.messages if self.conversation else []
        return next((i for i in range(len(msgs) - 1, -1, -1) if msgs[i].role == "user"), None)

    def _drop_from_last_user_message(self) -> None:
        last = self._last_user_index()
        if last is not None:
            self._drop_messages_from(last)

    def _drop_messages_from(self, position: int) -> None:
        conv = self.conversation
        self.store.delete_messages_from(conv.id, conv.messages[position].id)
        for msg in conv.messages[position:]:
            self._records.pop(msg.id, None)
        del conv.messages[position:]
        if self._pinned_bubble in self.pane.transcript.bubbles[position:]:
            self._unpin()
        self.pane.transcript.remove_from(position)

    # ---- the reply streaming in ------------------------------------------------------------
    def _is_active(self, request_id: int) -> bool:
        a = self.active
        return (
            a is not None
            and a.record.request_id == request_id
            and a.record.generation == self.host.generation
        )

    @Slot(int, list)
    def _on_tokens(self, request_id: int, events: list[TokenGenerated]) -> None:
        if not self._is_active(request_id):
            return
        a = self.active
        new = [ReplyToken(e.index, e.text_delta, e.logprob) for e in events]
        a.record.tokens.extend(new)
        a.text += "".join(e.text_delta for e in events)
        a.bubble.add_tokens(new, a.text)
        a.bubble.set_meta(f"generating… {len(a.record.tokens)} tokens", "live")
        try:
            a.checkpoint.update(a.text)
        except StorageError as exc:
            self.status_message.emit(str(exc), "error")

    @Slot(object)
    def _on_finished(self, event: RequestFinished) -> None:
        if self._is_active(event.request_id):
            self.active.record.stats = event.stats
            self._end_reply(event.text, event.finish_reason)

    @Slot(object)
    def _on_failed(self, event: RequestFailed) -> None:
        if self._is_active(event.request_id):
            self.status_message.emit(f"The reply failed: {event.message}", "error")
            self._end_reply(self.active.text, "failed")

    def _end_reply(self, text: str, finish_reason: str) -> None:
        a, self.active = self.active, None
        a.message.content, a.message.finish_reason = text, finish_reason
        a.bubble.set_text(text)
        kind = "error" if finish_reason == "failed" else ""
        turns = self.conversation.messages if self.conversation else []
        earlier = (self._records.get(m.id) for m in turns if m.id != a.message.id)
        uncached = first_uncached(r.stats for r in earlier if r is not None)
        a.bubble.set_meta(reply_meta(finish_reason, a.record.stats, uncached), kind)
        try:
            a.checkpoint.finish(text, finish_reason)
        except StorageError as exc:
            self.status_message.emit(str(exc), "error")
        self.refresh_sidebar()
        self.sync_state()

    # ---- token selection -------------------------------------------------------------------
    @Slot(object)
    def _on_token_hovered(self, index: int | None) -> None:
        bubble = self.sender()
        if index is not None and self._inspectable(bubble):
            self.token_inspected.emit(bubble.request_id, index)
        elif self._pinned is not None:
            self.token_inspected.emit(*self._pinned)
        else:
            self.token_inspected.emit(None, None)

    @Slot(int)
    def _on_token_clicked(self, index: int) -> None:
        bubble = self.sender()
        if not self._inspectable(bubble):
            return
        if self._pinned == (bubble.request_id, index):
            self._unpin()
            self.token_inspected.emit(None, None)
            return
        self._pin(bubble, index)

    def inspect_token(self, request_id: int, index: int) -> None:
        """Select a token of a reply from code (as a click does): the scripted screenshot."""
        bubble = next((b for b in self.pane.transcript.bubbles if b.request_id == request_id), None)
        if bubble is not None and self._inspectable(bubble):
            self._pin(bubble, index)

    def _pin(self, bubble: MessageBubble, index: int) -> None:
        self._unpin()
        self._pinned, self._pinned_bubble = (bubble.request_id, index), bubble
        bubble.set_selected_token(index)
        self.token_inspected.emit(bubble.request_id, index)

    def _inspectable(self, bubble) -> bool:
        """Only replies made by the running engine: request ids restart with each engine."""
        if not isinstance(bubble, MessageBubble) or bubble.request_id is None:
            return False
        return any(
            r.request_id == bubble.request_id and r.generation == self.host.generation
            for r in self._records.values()
        )

    def _unpin(self) -> None:
        if self._pinned_bubble is not None and self._pinned_bubble in self.pane.transcript.bubbles:
            self._pinned_bubble.set_selected_token(None)
        self._pinned, self._pinned_bubble = None, None

    @Slot()
    def forget_token_data(self) -> None:
        """A new engine started: earlier replies stay as text; their tokens cannot be inspected."""
        self._unpin()
        for bubble in self.pane.transcript.bubbles:
            if bubble.tokens:
                bubble.tokens.clear()
                bubble.request_id = None
                bubble.set_text(bubble.text)
        self._records = {k: r for k, r in self._records.items() if r.generation == self.host.generation}

    # ---- misc ------------------------------------------------------------------------------
    @Slot(str)
    def _on_system_prompt_edited(self, text: str) -> None:
        if self.conversation is not None:
            try:
                self.store.set_system_prompt(self.conversation.id, text)
                self.conversation.system_prompt = text
            except StorageError as exc:
                self.status_message.emit(str(exc), "error")

    @Slot()
    def sync_state(self) -> None:
        status = self.host.status()
        msgs = self.conversation.messages if self.conversation else []
        generating = self.active is not None
        self.pane.set_state(
            model_ready=status.ready,
            loading=status.loading,
            generating=generating,
            can_regenerate=bool(msgs),
            can_edit=self._last_user_index() is not None,
        )
        self.sidebar.setEnabled(not generating)
        self.sidebar.setToolTip("Stop the reply to switch conversations" if generating else "")
