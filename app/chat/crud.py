"""The chat controller's conversations: new, open, rename, delete, export, import, search hits,
and the transcript of the visible path with its forks (◀ 2/3 ▶).

A mixin of ChatController (app.chat.controller), which holds the state it reads.
"""

from __future__ import annotations

from pathlib import Path

from app.chat.exchange import export_json, export_markdown, import_json
from app.chat.group_reply import GroupReply
from app.chat.group_reply_view import GroupReplyCard
from app.chat.reply_stats import KeptStats, details_text, dropped_before, header_text, stored_sampling
from app.chat.tree import StoredMessage
from app.chat.view import MessageBubble
from app.prefix_ttft import first_uncached, prefix_cache_note

USER_AUTHOR = "You"
EXPORT_FORMATS = ("markdown", "json", "json-path")  # the visible path as Markdown, the tree, the path
CONTINUABLE = ("interrupted", "cancelled", "length")  # replies that ended before the model did


class ConversationActions:
    # ---- conversations ---------------------------------------------------------------------
    def new_conversation(self) -> None:
        if self.busy:
            return
        self.conversation = None
        self.pane.transcript.clear()
        self._load_chat_settings()  # a new chat keeps the settings shown until it is saved
        self._set_editing(None)
        self.pane.input.clear()
        self.refresh_sidebar()
        self.sync_state()
        self.schedule_measure()

    def open_conversation(self, conversation_id: int, leaf_id: int | None = None) -> None:
        """Show a stored conversation (at `leaf_id`'s path when given, else where it was left)."""
        same = self.conversation is not None and self.conversation.id == conversation_id
        if self.busy or (same and leaf_id is None):
            return
        conv = self.store.load(conversation_id)
        if conv is None:
            self.status_message.emit(f"Conversation {conversation_id} no longer exists.", "error")
            self.refresh_sidebar()
            return
        self.conversation = conv
        if leaf_id is not None and leaf_id in conv.nodes:
            self.show_leaf(leaf_id)
        self.pane.set_system_prompt(conv.system_prompt)
        self._load_chat_settings()
        self._set_editing(None)
        self._render_transcript()
        self.refresh_sidebar()
        self.sync_state()
        self.schedule_measure()

    def open_message(self, conversation_id: int, message_id: int) -> None:
        """A search hit: open its conversation on a path through that message."""
        conv = self.conversation if self.conversation and self.conversation.id == conversation_id else None
        conv = conv or self.store.load(conversation_id)
        if conv is None or message_id not in conv.nodes:
            self.status_message.emit("That message no longer exists.", "error")
            return
        if self.conversation is conv:
            self.show_leaf(conv.newest_leaf(message_id))
            self._render_transcript()
            self.schedule_measure()
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
        if self.busy and self.conversation and self.conversation.id == conversation_id:
            self.status_message.emit("Stop the reply before deleting its conversation.", "error")
            return
        self.store.delete(conversation_id)
        if self.conversation and self.conversation.id == conversation_id:
            self.new_conversation()
        self.refresh_sidebar()

    def export_to(self, conversation_id: int, fmt: str, path: Path) -> None:
        """Markdown of the visible path, JSON of the whole tree ("json") or of the path."""
        from app.chat.conversations import StorageError

        conv = self.store.load(conversation_id)
        if conv is None:
            raise StorageError(f"Conversation {conversation_id} no longer exists.")
        if self.conversation is not None and self.conversation.id == conversation_id:
            conv.show(self.conversation.leaf_id)  # the path on screen, even mid-stream
        if fmt == "markdown":
            text = export_markdown(conv)
        else:
            text = export_json(conv, scope="path" if fmt == "json-path" else "tree")
        Path(path).write_text(text, encoding="utf-8")

    def import_from(self, path: Path) -> int:
        """Store an exported conversation and open it; ImportFailed / OSError say why not."""
        conversation_id = import_json(self.store, Path(path).read_text(encoding="utf-8"))
        self.refresh_sidebar()
        if not self.busy:
            self.open_conversation(conversation_id)
        return conversation_id

    # ---- the visible path ------------------------------------------------------------------
    def show_leaf(self, leaf_id: int | None) -> None:
        """Show the path to `leaf_id` and remember it for the next opening."""
        conv = self.conversation
        conv.show(leaf_id)
        self._write(lambda: self.store.set_current_leaf(conv.id, conv.leaf_id))

    def step_fork(self, bubble: MessageBubble, step: int) -> None:
        """◀ / ▶ on a message: show its previous / next sibling and that one's newest line."""
        conv = self.conversation
        msg = conv.nodes.get(bubble.message_id) if conv and bubble.message_id is not None else None
        if msg is None or self.busy:
            return
        siblings = conv.siblings(msg)
        position = next(i for i, m in enumerate(siblings) if m.id == msg.id) + step
        if 0 <= position < len(siblings):
            self.show_leaf(conv.newest_leaf(siblings[position].id))
            self._set_editing(None)
            self._render_transcript()
            self.sync_state()
            self.schedule_measure()

    def _render_transcript(self) -> None:
        self._unpin()
        self.pane.transcript.clear()
        for msg in self.conversation.messages if self.conversation else []:
            self._add_bubble(msg)
        self._mark_context()

    def _add_bubble(self, msg: StoredMessage, live_group: tuple[str, int] | None = None) -> MessageBubble:
        """The message's bubble at the end of the transcript; `live_group` (kind, size): a reply
        of several sequences about to stream into a card."""
        author = USER_AUTHOR if msg.role == "user" else (msg.model or "Assistant")
        record = self._records.get(msg.id)
        stored_group = GroupReply.from_meta(msg.meta) if msg.role == "assistant" else None
        if live_group is not None:
            bubble = self._add_group_card(msg, *live_group)
        elif stored_group is not None:
            bubble = self._add_group_card(
                msg, stored_group.kind, len(stored_group.alternatives), stored_group
            )
        else:
            bubble = MessageBubble(msg.role, author, record.request_id if record else None)
            bubble.set_view(*self.pane.view_flags())
            if record is not None and record.generation == self.host.generation:
                bubble.token_lead = record.lead_text
                bubble.add_tokens(record.tokens, msg.content)
            else:
                bubble.set_text(msg.content)
            bubble.token_hovered.connect(self._on_token_hovered)
            bubble.token_clicked.connect(self._on_token_clicked)
            self.pane.transcript.add(bubble)
        bubble.message_id = msg.id
        bubble.fork_step.connect(lambda step, b=bubble: self.step_fork(b, step))
        bubble.action_requested.connect(lambda name, b=bubble: self.on_message_action(b, name))
        bubble.code_copied.connect(
            lambda _i: self.status_message.emit("Code copied to the clipboard", "info")
        )
        self._decorate(bubble, msg)
        if msg.role == "assistant" and live_group is None and stored_group is None:
            self._show_tool_cards(bubble, msg)
        return bubble

    def _decorate(self, bubble: MessageBubble, msg: StoredMessage) -> None:
        """A bubble's fork position, header figures, menu and Continue, from the stored message."""
        conv = self.conversation
        in_tree = conv is not None and msg.id in conv.nodes
        bubble.set_fork(*(conv.fork_position(msg) if in_tree else (1, 1)))
        if msg.role != "assistant":
            return
        kept = KeptStats.from_meta(msg.meta)
        note = ""
        if kept is not None and in_tree:
            path = conv.messages
            before = [m for m in path[: path.index(msg)] if m.role == "assistant"] if msg in path else []
            uncached = first_uncached(KeptStats.from_meta(m.meta) for m in before)
            note = prefix_cache_note(kept, uncached)
        kind = "error" if msg.finish_reason in ("failed", "interrupted") else ""
        bubble.set_meta(header_text(msg.finish_reason, kept, note), kind)
        settings = stored_sampling(msg.meta)
        bubble.set_meta_tooltip(details_text(kept, settings))
        is_group = isinstance(bubble, GroupReplyCard)
        bubble.set_action_enabled(
            "regenerate_same",
            settings is not None,
            "This reply was made before kvscope kept each reply's settings",
        )
        can_continue = msg.finish_reason in CONTINUABLE and not is_group
        bubble.set_action_enabled(
            "continue", can_continue, "Only a reply that was stopped, cut off or hit its token limit goes on"
        )
        bubble.set_continuable(
            msg.finish_reason == "interrupted" and not is_group, "Continue the interrupted reply"
        )

    def _mark_context(self) -> None:
        """Dim the messages the latest reply's prompt left out (the context limit)."""
        path = self.conversation.messages if self.conversation else []
        last_reply = next((m for m in reversed(path) if m.role == "assistant"), None)
        first_kept = dropped_before(last_reply.meta) if last_reply is not None else 0
        if self.active is not None and self.active.context:
            first_kept = self.active.context.get("first_kept", 0)
        for i, bubble in enumerate(self.pane.transcript.bubbles):
            bubble.set_outside_context(i < first_kept)

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
