"""The chat's behaviour: turns user actions into engine requests and stored messages, and the
engine's tokens into a streaming reply that is saved as it grows.

Owns the current conversation (None until its first message, so opening the app does not pile
up empty conversations), the reply in flight and the token selection shown in the
probability panel.

A reply asked for as n samples or by beam search streams into a `GroupReplyCard` (samples side
by side; beams as a live tree, then ranked); the engine's best is stored as the message until
the user keeps another alternative, and every alternative is stored with it as metadata.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from PySide6.QtCore import QObject, Signal, Slot

from app.chat.conversation_list import ConversationList
from app.chat.conversations import (
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
from app.chat.group_reply import GroupReply
from app.chat.group_reply_view import GroupReplyCard
from app.chat.rich_text import ReplyToken
from app.chat.view import ChatPane, MessageBubble
from app.engine_host import EngineHost
from app.prefix_ttft import first_uncached, prefix_cache_note
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
    # n samples or beams: the card they stream into, and each sample's text and token count.
    group: GroupReplyCard | None = None
    sample_texts: dict[int, str] = field(default_factory=dict)
    sample_tokens: dict[int, int] = field(default_factory=dict)


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
        host.frame.connect(self._on_frame)
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
        stored_group = GroupReply.from_meta(msg.meta) if msg.role == "assistant" else None
        if stored_group is not None:
            return self._add_group_card(msg, stored_group.kind, len(stored_group.alternatives), stored_group)
        bubble = MessageBubble(msg.role, author, record.request_id if record else None)
        bubble.set_view(*self.pane.view_flags())
        if record is not None and record.generation == self.host.generation:
            bubble.add_tokens(record.tokens, msg.content)
        else:
            bubble.set_text(msg.content)
        bubble.token_hovered.connect(self._on_token_hovered)
        bubble.token_clicked.connect(self._on_token_clicked)
        return self.pane.transcript.add(bubble)

    def _add_group_card(
        self, msg: StoredMessage, kind: str, size: int, reply: GroupReply | None = None
    ) -> GroupReplyCard:
        """A reply of several sequences: live (reply None, fed by the store) or as stored."""
        record = self._records.get(msg.id)
        # Made by the running engine: its beam steps are still in the store, the tree can show.
        this_engine = record is not None and record.generation == self.host.generation
        live = self.host.live if reply is None or this_engine else None
        card = GroupReplyCard(
            msg.model or "Assistant", record.request_id if record else None, kind, size, live
        )
        card.message_id = msg.id
        card.set_view(*self.pane.view_flags())
        if reply is not None:
            card.show_results(reply)
            card.set_text(reply.kept_text)
        card.keep_requested.connect(self._on_keep_requested)
        return self.pane.transcript.add(card)

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
        sampling = self._sampling()
        try:
            request_id = self.host.submit(Request(messages=messages, sampling=sampling))
            msg = self.store.add_message(conv.id, "assistant", "", model=self.host.model_name)
        except (RuntimeError, ConfigError, StorageError) as exc:
            self.status_message.emit(f"Could not start the reply: {exc}", "error")
            self.sync_state()
            return
        conv.messages.append(msg)
        record = ReplyRecord(self.host.generation, request_id)
        self._records[msg.id] = record
        group = None
        if sampling.group_size > 1:
            kind = "beams" if sampling.beam_search else "samples"
            bubble = group = self._add_group_card(msg, kind, sampling.group_size)
        else:
            bubble = self._add_bubble(msg)
        bubble.set_meta("generating…", "live")
        self.active = ActiveReply(msg, bubble, ReplyCheckpoint(self.store, msg.id), record, group=group)
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
        if a.group is not None:
            self._on_sample_tokens(a, events)
            return
        new = [ReplyToken(e.index, e.text_delta, e.logprob) for e in events]
        a.record.tokens.extend(new)
        a.text += "".join(e.text_delta for e in events)
        a.bubble.add_tokens(new, a.text)
        a.bubble.set_meta(f"generating… {len(a.record.tokens)} tokens", "live")
        try:
            a.checkpoint.update(a.text)
        except StorageError as exc:
            self.status_message.emit(str(exc), "error")

    def _on_sample_tokens(self, a: ActiveReply, events: list[TokenGenerated]) -> None:
        """n samples: each token extends its own sample's column (TokenGenerated.branch)."""
        for e in events:
            a.sample_texts[e.branch] = a.sample_texts.get(e.branch, "") + e.text_delta
            a.sample_tokens[e.branch] = a.sample_tokens.get(e.branch, 0) + 1
        for branch in {e.branch for e in events}:
            a.group.set_sample_text(branch, a.sample_texts[branch], a.sample_tokens[branch])
        a.text = a.sample_texts.get(0, "")
        a.bubble.set_meta(f"generating… {sum(a.sample_tokens.values())} tokens", "live")
        partial = GroupReply.streaming(a.sample_texts, a.group.size)
        try:
            a.checkpoint.update(a.text, partial.to_meta())
        except StorageError as exc:
            self.status_message.emit(str(exc), "error")

    @Slot(object)
    def _on_frame(self, dirty: set[str]) -> None:
        if self.active is not None and self.active.group is not None:
            self.active.group.refresh(dirty)

    @Slot(object)
    def _on_finished(self, event: RequestFinished) -> None:
        if not self._is_active(event.request_id):
            return
        a = self.active
        a.record.stats = event.stats
        if a.group is None:
            self._end_reply(event.text, event.finish_reason)
            return
        a.group.refresh({"groups"})
        reply = GroupReply.from_finished(event, a.group.kind)
        a.group.show_results(reply)
        self._end_reply(reply.kept_text, event.finish_reason, reply.to_meta())

    @Slot(object)
    def _on_failed(self, event: RequestFailed) -> None:
        if self._is_active(event.request_id):
            self.status_message.emit(f"The reply failed: {event.message}", "error")
            a = self.active
            partial = GroupReply.streaming(a.sample_texts, a.group.size) if a.sample_texts else None
            self._end_reply(a.text, "failed", partial.to_meta() if partial else None)

    def _end_reply(self, text: str, finish_reason: str, meta: dict | None = None) -> None:
        a, self.active = self.active, None
        a.message.content, a.message.finish_reason, a.message.meta = text, finish_reason, meta
        a.bubble.set_text(text)
        kind = "error" if finish_reason == "failed" else ""
        turns = self.conversation.messages if self.conversation else []
        earlier = (self._records.get(m.id) for m in turns if m.id != a.message.id)
        uncached = first_uncached(r.stats for r in earlier if r is not None)
        a.bubble.set_meta(reply_meta(finish_reason, a.record.stats, uncached), kind)
        try:
            a.checkpoint.finish(text, finish_reason, meta)
        except StorageError as exc:
            self.status_message.emit(str(exc), "error")
        self.refresh_sidebar()
        self.sync_state()

    # ---- keeping one of several alternatives -----------------------------------------------
    @Slot(int)
    def _on_keep_requested(self, branch: int) -> None:
        card = self.sender()
        if isinstance(card, GroupReplyCard):
            self.keep(card, branch)

    def keep(self, card: GroupReplyCard, branch: int) -> None:
        """Make one alternative of the last reply THE reply: its text becomes the stored message."""
        conv = self.conversation
        msg = next((m for m in conv.messages if m.id == card.message_id), None) if conv else None
        reply = GroupReply.from_meta(msg.meta) if msg is not None else None
        alternative = reply.alternative(branch) if reply is not None else None
        if alternative is None or self.active is not None or msg is not conv.messages[-1]:
            return
        reply.kept = branch
        meta = reply.to_meta()
        finish_reason = alternative.finish_reason or msg.finish_reason
        try:
            self.store.update_message(msg.id, alternative.text, finish_reason, meta)
        except StorageError as exc:
            self.status_message.emit(str(exc), "error")
            return
        msg.content, msg.finish_reason, msg.meta = alternative.text, finish_reason, meta
        card.set_kept(branch)

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
        self._sync_keep_buttons(generating)
        self.sidebar.setEnabled(not generating)
        self.sidebar.setToolTip("Stop the reply to switch conversations" if generating else "")

    def _sync_keep_buttons(self, generating: bool) -> None:
        # Only the last reply's choice can change: later turns continued from the kept text.
        bubbles = self.pane.transcript.bubbles
        for i, bubble in enumerate(bubbles):
            if isinstance(bubble, GroupReplyCard):
                last = i == len(bubbles) - 1
                reason = (
                    "" if last else "Only the last reply can be changed: later turns continued from this one"
                )
                bubble.set_keep_enabled(last and not generating, reason)
