"""The chat's token selection: hovering a token of a reply shows its distribution in the
probability panel, a click pins it there. Only replies of the running engine can be inspected
(request ids restart with each engine). A branch's first tokens are those of the reply it came
from, and show that reply's distributions."""

from __future__ import annotations

from app.chat.bubble import MessageBubble
from app.chat.session import ChatSession, ChatSignals
from app.chat.view import ChatPane
from app.engine_host import EngineHost


class TokenPinning:
    def __init__(self, pane: ChatPane, host: EngineHost, session: ChatSession, signals: ChatSignals) -> None:
        self.pane, self.host, self.session, self.signals = pane, host, session, signals
        self.pinned: tuple[int | None, int] | None = None  # (request id, token index)
        self._bubble: MessageBubble | None = None
        self._position: int | None = None

    def on_token_hovered(self, bubble: MessageBubble, position: int | None) -> None:
        if position is not None and self._inspectable(bubble) and 0 <= position < len(bubble.tokens):
            self.signals.inspected(*bubble.token_key(position))
        elif self.pinned is not None:
            self.signals.inspected(*self.pinned)
        else:
            self.signals.inspected(None, None)

    def on_token_clicked(self, bubble: MessageBubble, position: int) -> None:
        if not self._inspectable(bubble) or not 0 <= position < len(bubble.tokens):
            return
        if self._bubble is bubble and self._position == position:
            self.unpin()
            self.signals.inspected(None, None)
            return
        self._pin(bubble, position)

    def inspect_token(self, request_id: int, index: int) -> None:
        """Select a token of a reply from code (as a click does): the scripted screenshot."""
        for bubble in self.pane.transcript.bubbles:
            if not self._inspectable(bubble):
                continue
            for position in range(len(bubble.tokens)):
                if bubble.token_key(position) == (request_id, index):
                    self._pin(bubble, position)
                    return

    def _pin(self, bubble: MessageBubble, position: int) -> None:
        self.unpin()
        self.pinned = bubble.token_key(position)
        self._bubble, self._position = bubble, position
        bubble.set_selected_token(position)
        self.signals.inspected(*self.pinned)

    def _inspectable(self, bubble: MessageBubble) -> bool:
        """Only replies made by the running engine: request ids restart with each engine."""
        if bubble.request_id is None:
            return False
        return any(
            r.request_id == bubble.request_id and r.generation == self.host.generation
            for r in self.session.records.values()
        )

    def unpin(self) -> None:
        if self._bubble is not None and self._bubble in self.pane.transcript.bubbles:
            self._bubble.set_selected_token(None)
        self.pinned, self._bubble, self._position = None, None, None

    def forget_token_data(self) -> None:
        """A new engine started: earlier replies stay as text; their tokens cannot be inspected."""
        self.unpin()
        for bubble in self.pane.transcript.bubbles:
            if bubble.tokens or bubble.token_lead:
                bubble.tokens.clear()
                bubble.token_lead = ""
                bubble.request_id = None
                bubble.set_text(bubble.text)
        records = self.session.records
        for message_id in [k for k, r in records.items() if r.generation != self.host.generation]:
            del records[message_id]
