"""The chat controller's token selection: hovering a token of a reply shows its distribution in
the probability panel, a click pins it there. Only replies of the running engine can be
inspected (request ids restart with each engine). A branch's first tokens are those of the
reply it came from, and show that reply's distributions.

A mixin of ChatController (app.chat.controller).
"""

from __future__ import annotations

from app.chat.view import MessageBubble


class TokenPinning:
    def _on_token_hovered(self, position: int | None) -> None:
        bubble = self.sender()
        if position is not None and self._inspectable(bubble) and 0 <= position < len(bubble.tokens):
            self.token_inspected.emit(*bubble.token_key(position))
        elif self._pinned is not None:
            self.token_inspected.emit(*self._pinned)
        else:
            self.token_inspected.emit(None, None)

    def _on_token_clicked(self, position: int) -> None:
        bubble = self.sender()
        if not self._inspectable(bubble) or not 0 <= position < len(bubble.tokens):
            return
        if self._pinned_bubble is bubble and self._pinned_position == position:
            self._unpin()
            self.token_inspected.emit(None, None)
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
        self._unpin()
        self._pinned = bubble.token_key(position)
        self._pinned_bubble, self._pinned_position = bubble, position
        bubble.set_selected_token(position)
        self.token_inspected.emit(*self._pinned)

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
        self._pinned, self._pinned_bubble, self._pinned_position = None, None, None

    def forget_token_data(self) -> None:
        """A new engine started: earlier replies stay as text; their tokens cannot be inspected."""
        self._unpin()
        for bubble in self.pane.transcript.bubbles:
            if bubble.tokens or bubble.token_lead:
                bubble.tokens.clear()
                bubble.token_lead = ""
                bubble.request_id = None
                bubble.set_text(bubble.text)
        self._records = {k: r for k, r in self._records.items() if r.generation == self.host.generation}
