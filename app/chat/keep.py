"""The chat's choice among a reply's alternatives (n samples, beams): keeping one makes its text
the stored reply the conversation continues from; all stay in its metadata."""

from __future__ import annotations

from app.chat.conversations import ConversationStore, StorageError
from app.chat.group_reply import GroupReply
from app.chat.group_reply_view import GroupReplyCard
from app.chat.session import ChatSession, ChatSignals
from app.chat.view import ChatPane

ONLY_LAST = "Only the last reply can be changed: later turns continued from this one"


class KeepAlternative:
    def __init__(
        self, pane: ChatPane, store: ConversationStore, session: ChatSession, signals: ChatSignals
    ) -> None:
        self.pane, self.store, self.session, self.signals = pane, store, session, signals

    def keep(self, card: GroupReplyCard, branch: int) -> None:
        """Make one alternative of the last reply THE reply: its text becomes the stored message."""
        path = self.session.path
        msg = next((m for m in path if m.id == card.message_id), None)
        reply = GroupReply.from_meta(msg.meta) if msg is not None else None
        alternative = reply.alternative(branch) if reply is not None else None
        if msg is None or reply is None or alternative is None or self.session.busy or msg is not path[-1]:
            return
        reply.kept = branch
        meta = {**(msg.meta or {}), **reply.to_meta()}  # the kept stats and settings stay
        finish_reason = alternative.finish_reason or msg.finish_reason
        try:
            self.store.update_message(msg.id, alternative.text, finish_reason, meta)
        except StorageError as exc:
            self.signals.status(str(exc), "error")
            return
        msg.content, msg.finish_reason, msg.meta = alternative.text, finish_reason, meta
        card.set_kept(branch)

    def sync_keep_buttons(self, generating: bool) -> None:
        # Only the last reply's choice can change: later turns continued from the kept text.
        bubbles = self.pane.transcript.bubbles
        for i, bubble in enumerate(bubbles):
            if isinstance(bubble, GroupReplyCard):
                last = i == len(bubbles) - 1
                bubble.set_keep_enabled(last and not generating, "" if last else ONLY_LAST)
