"""The chat controller's choice among a reply's alternatives (n samples, beams): keeping one
makes its text the stored reply the conversation continues from; all stay in its metadata.

A mixin of ChatController (app.chat.controller).
"""

from __future__ import annotations

from app.chat.conversations import StorageError
from app.chat.group_reply import GroupReply
from app.chat.group_reply_view import GroupReplyCard

ONLY_LAST = "Only the last reply can be changed: later turns continued from this one"


class KeepAlternative:
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
        if alternative is None or self.busy or msg is not conv.messages[-1]:
            return
        reply.kept = branch
        meta = {**msg.meta, **reply.to_meta()}  # the kept stats and settings stay
        finish_reason = alternative.finish_reason or msg.finish_reason
        try:
            self.store.update_message(msg.id, alternative.text, finish_reason, meta)
        except StorageError as exc:
            self.status_message.emit(str(exc), "error")
            return
        msg.content, msg.finish_reason, msg.meta = alternative.text, finish_reason, meta
        card.set_kept(branch)

    def _sync_keep_buttons(self, generating: bool) -> None:
        # Only the last reply's choice can change: later turns continued from the kept text.
        bubbles = self.pane.transcript.bubbles
        for i, bubble in enumerate(bubbles):
            if isinstance(bubble, GroupReplyCard):
                last = i == len(bubbles) - 1
                bubble.set_keep_enabled(last and not generating, "" if last else ONLY_LAST)
