"""The transcript of the visible path: a bubble per message (a card for a reply of several
sequences), each with its fork position (◀ 2/3 ▶), header figures, menu and Continue, the
messages the context limit left out dimmed, and ◀ ▶ moving to a sibling's newest line."""

from __future__ import annotations

from collections.abc import Callable

from app.chat.bubble import MessageBubble
from app.chat.conversations import ConversationStore
from app.chat.group_reply import GroupReply
from app.chat.group_reply_view import GroupReplyCard
from app.chat.pinning import TokenPinning
from app.chat.reply_stats import KeptStats, details_text, dropped_before, header_text, stored_sampling
from app.chat.session import ChatSession, ChatSignals, set_editing, write_or_say
from app.chat.tree import StoredMessage
from app.chat.view import ChatPane
from app.engine_host import EngineHost
from app.prefix_ttft import first_uncached, prefix_cache_note

USER_AUTHOR = "You"
CONTINUABLE = ("interrupted", "cancelled", "length")  # replies that ended before the model did

# What a bubble's menu asks for (a name of MESSAGE_ACTIONS), and a card's Keep (its branch).
MessageAction = Callable[[MessageBubble, str], None]
Keep = Callable[[GroupReplyCard, int], None]
# The cards under a reply's bubble (its tool calls, app.chat.tool_rounds).
Cards = Callable[[MessageBubble, StoredMessage], None]


class Transcript:
    def __init__(
        self,
        pane: ChatPane,
        store: ConversationStore,
        host: EngineHost,
        session: ChatSession,
        signals: ChatSignals,
        pinning: TokenPinning,
        on_action: MessageAction,
        on_keep: Keep,
        cards: Cards,
    ) -> None:
        self.pane, self.store, self.host, self.session, self.signals = pane, store, host, session, signals
        self.pinning = pinning
        self._on_action, self._on_keep, self._cards = on_action, on_keep, cards

    # ---- the visible path ------------------------------------------------------------------
    def show_leaf(self, leaf_id: int | None) -> None:
        """Show the path to `leaf_id` and remember it for the next opening."""
        conv = self.session.conversation
        assert conv is not None, "a leaf is shown in an open conversation"
        conv.show(leaf_id)
        write_or_say(self.signals, lambda: self.store.set_current_leaf(conv.id, conv.leaf_id))

    def step_fork(self, bubble: MessageBubble, step: int) -> None:
        """◀ / ▶ on a message: show its previous / next sibling and that one's newest line."""
        session = self.session
        conv, msg = session.conversation, session.message(bubble.message_id)
        if conv is None or msg is None or session.busy:
            return
        siblings = conv.siblings(msg)
        position = next(i for i, m in enumerate(siblings) if m.id == msg.id) + step
        if 0 <= position < len(siblings):
            self.show_leaf(conv.newest_leaf(siblings[position].id))
            set_editing(session, self.pane, None)
            self.render()
            self.signals.sync()
            self.signals.measure()

    def render(self) -> None:
        """Draw the whole visible path again."""
        self.pinning.unpin()
        self.pane.transcript.clear()
        for msg in self.session.path:
            self.add_bubble(msg)
        self.mark_context()

    def sync_path(self, reply: StoredMessage, live_group: tuple[str, int] | None) -> MessageBubble:
        """Make the transcript show the conversation's path: append what is new when the shown
        bubbles are its beginning, else draw it again. Returns the reply's bubble."""
        path = self.session.path
        shown = [b.message_id for b in self.pane.transcript.bubbles]
        if shown != [m.id for m in path[: len(shown)]] or reply.id in shown:
            self.pinning.unpin()
            self.pane.transcript.clear()
            shown = []
        for msg in path[len(shown) :]:
            self.add_bubble(msg, live_group if msg.id == reply.id else None)
        return self.pane.transcript.bubbles[-1]

    def add_bubble(self, msg: StoredMessage, live_group: tuple[str, int] | None = None) -> MessageBubble:
        """The message's bubble at the end of the transcript; `live_group` (kind, size): a reply
        of several sequences about to stream into a card."""
        author = USER_AUTHOR if msg.role == "user" else (msg.model or "Assistant")
        record = self.session.records.get(msg.id)
        stored_group = GroupReply.from_meta(msg.meta) if msg.role == "assistant" else None
        bubble: MessageBubble
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
            pinning = self.pinning
            bubble.token_hovered.connect(lambda position, b=bubble: pinning.on_token_hovered(b, position))
            bubble.token_clicked.connect(lambda position, b=bubble: pinning.on_token_clicked(b, position))
            self.pane.transcript.add(bubble)
        bubble.message_id = msg.id
        bubble.fork_step.connect(lambda step, b=bubble: self.step_fork(b, step))
        bubble.action_requested.connect(lambda name, b=bubble: self._on_action(b, name))
        bubble.code_copied.connect(lambda _i: self.signals.status("Code copied to the clipboard", "info"))
        self.decorate(bubble, msg)
        if msg.role == "assistant" and live_group is None and stored_group is None:
            self._cards(bubble, msg)
        return bubble

    def decorate(self, bubble: MessageBubble, msg: StoredMessage) -> None:
        """A bubble's fork position, header figures, menu and Continue, from the stored message."""
        conv = self.session.conversation
        in_tree = conv is not None and msg.id in conv.nodes
        bubble.set_fork(*(conv.fork_position(msg) if conv is not None and in_tree else (1, 1)))
        if msg.role != "assistant":
            return
        kept = KeptStats.from_meta(msg.meta)
        note = ""
        if kept is not None and in_tree:
            path = self.session.path
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

    def mark_context(self) -> None:
        """Dim the messages the latest reply's prompt left out (the context limit)."""
        path = self.session.path
        last_reply = next((m for m in reversed(path) if m.role == "assistant"), None)
        first_kept = dropped_before(last_reply.meta) if last_reply is not None else 0
        active = self.session.active
        if active is not None and active.context:
            first_kept = active.context.get("first_kept", 0)
        for i, bubble in enumerate(self.pane.transcript.bubbles):
            bubble.set_outside_context(i < first_kept)

    def _add_group_card(
        self, msg: StoredMessage, kind: str, size: int, reply: GroupReply | None = None
    ) -> GroupReplyCard:
        """A reply of several sequences: live (reply None, fed by the store) or as stored."""
        record = self.session.records.get(msg.id)
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
        card.keep_requested.connect(lambda branch, c=card: self._on_keep(c, branch))
        self.pane.transcript.add(card)
        return card
